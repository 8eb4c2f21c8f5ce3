"""Exactness of token-level finetuning: any window schedule gives one whole-sequence backward's gradients."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coserve.finetune.reference import whole_sequence_loss
from coserve.finetune.sequence_state import IGNORE_INDEX, new_sequence_state
from coserve.finetune.pruned_layer import BASE_KEEPS, executor_plan, new_keeps, planned_keeps
from coserve.finetune.token_windows import backward_window, forward_window
from coserve.model.loader import load_model
from coserve.model.norm_grad import rms_norm_stats
from coserve.peft.config import IA3Config, LoraConfig
from coserve.peft.trainable import TrainableIA3, TrainableLora

BYPASSES = {
    "lora-dropout": LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["v_proj", "o_proj", "down_proj"]),
    "lora-attn": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "lora-mlp": LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "ia3": IA3Config(),
    "dora": LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, use_dora=True,
                       target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
}


def _bypass(name, model, seed):
    gen = torch.Generator().manual_seed(seed)
    cfg = BYPASSES[name]
    if isinstance(cfg, IA3Config):
        bypass = TrainableIA3(cfg, model.module_shapes(), model.cfg.num_layers, model.device)
        with torch.no_grad():  # away from ones, so that every path carries gradient
            for p in bypass.parameters():
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        return bypass
    bypass = TrainableLora(cfg, model.module_shapes(), model.cfg.num_layers, model.device, gen,
                           base_weight=model.module_weight if cfg.use_dora else None)
    with torch.no_grad():  # non-zero B so that A gets gradient too; DoRA magnitudes away from the norms
        for p in bypass.parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.shape[1] == cfg.r:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return bypass


def _windows(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([1, 1, 2, 3, rng.randint(1, n)]))
    return sizes


def _grads(bypass):
    return [p.grad.detach().clone() for p in bypass.parameters()]


def _one_sequence(model, bypass, rng: random.Random, n: int):
    """A random sequence of ``n`` tokens: a fresh state for it, and the bypass's gradients from one whole-sequence
    autograd backward of its mean loss (zeroed again after)."""
    ids = [rng.randrange(5, model.cfg.vocab_size) for _ in range(n)]
    targets = ids[1:] + [IGNORE_INDEX]
    bypass.zero_grad()
    (whole_sequence_loss(model, bypass, ids, targets) / (n - 1)).backward()
    ref = _grads(bypass)
    bypass.zero_grad()
    return new_sequence_state(ids, targets, model.cfg.num_layers, model.cfg.hidden_size, model.cfg.num_kv_heads,
                              model.cfg.head_dim, model.device, model.dtype), ref


SCHEDULES = [(0, "all"), (1, "all"), (0, "cheap"), (1, "cheap"), (0, "cheap:flops"), (0, "cheap:none"),
             (1, "cheap:every")]
# The Llama family's three layers under every schedule; the later architectures under one of each keep set.
CASES = [(arch, seed, remat) for arch in ("llama", "qwen2", "qwen3") for seed, remat in SCHEDULES] + [
    (arch, seed, remat) for arch in ("mistral:window=6", "gemma2", "gemma3", "granite", "smollm3", "olmo2")
    for seed, remat in ((0, "all"), (1, "cheap"), (0, "cheap:none"), (1, "cheap:every"))]


@pytest.mark.parametrize("kind", list(BYPASSES))
@pytest.mark.parametrize("arch,seed,remat", CASES)
def test_random_window_schedules_match_whole_sequence_autograd(model_factory, config_variant, arch, kind, seed, remat):
    """``cheap`` keeps the plan's tensors for these short sequences, as a job plans them (by its longest sequence);
    ``cheap:flops`` the plan FLOPs alone would pick for them (attention recomputed, gate and up kept); ``cheap:none``
    recomputes q, resid, gate and up; ``cheap:every`` keeps them (attention's output too: its kept-output backward
    under the sliding window's mask). ``mistral:window=6``: every layer slides over 6 positions (most of these
    sequences are longer)."""
    path = config_variant("mistral", sliding_window=6) if ":window=" in arch else model_factory(arch)
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert model.cfg.sliding_window == {"mistral:window=6": 6, "gemma2": 32, "gemma3": 32}.get(arch)
    rng = random.Random(seed)
    bypass = _bypass(kind, model, seed)
    seqs = []
    for _ in range(2):  # a mini-batch of two sequences, gradients accumulated
        n = rng.randint(5, 23)
        ids = [rng.randrange(5, model.cfg.vocab_size) for _ in range(n)]
        targets = ids[1:] + [IGNORE_INDEX]
        targets = [t if rng.random() > 0.3 else IGNORE_INDEX for t in targets]  # masked prompt tokens
        seqs.append((ids, targets))
    total = sum(sum(t != IGNORE_INDEX for t in tg) for _, tg in seqs)

    bypass.zero_grad()
    ref_loss = sum(whole_sequence_loss(model, bypass, ids, tg, dropout_seed=n)
                   for n, (ids, tg) in enumerate(seqs)) / total
    ref_loss.backward()
    ref = _grads(bypass)

    bypass.zero_grad()
    loss = 0.0
    for n, (ids, tg) in enumerate(seqs):
        state = new_sequence_state(ids, tg, model.cfg.num_layers, model.cfg.hidden_size, model.cfg.num_kv_heads,
                                   model.cfg.head_dim, model.device, model.dtype)
        state.dropout_seed = n
        if remat.startswith("cheap"):
            longest = max(len(i) for i, _ in seqs)
            charge = {"cheap": None, "cheap:flops": 0}  # per dispatched operation: the device's, or none
            names = (planned_keeps(executor_plan(model, bypass.config, "cheap", max_tokens=longest,
                                                 dispatch_flops=charge[remat]))
                     if remat in charge else {"cheap:none": (), "cheap:every": BASE_KEEPS}[remat])
            state.keeps = new_keeps(model, len(ids), names)
        for size in _windows(rng, len(ids)):
            loss += forward_window(model, bypass, state, size, 1.0 / total)
        while not state.finished:
            backward_window(model, bypass, state, rng.choice(_windows(rng, len(ids))))
        assert {w[1] for w in state.window_log if w[0] == "backward"} == set(range(model.cfg.num_layers))
    got = _grads(bypass)

    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    for g, r in zip(got, ref):
        assert r.abs().max() > 0
        rel = (g - r).norm() / r.norm()
        assert rel <= 1e-5, float(rel)


@pytest.mark.parametrize("remat", ["all", "cheap", "cheap:none"])
def test_wide_qwen3_heads_match_whole_sequence_autograd(model_factory, remat):
    """Qwen3's shape, heads wider than hidden / heads (q and o 128 wide over a hidden state of 64), LoRA on every
    attention projection: random windows give the whole-sequence backward's gradients."""
    model = load_model(model_factory("qwen3", head_dim=32), torch.float32, torch.device("cpu"))
    bypass = _bypass("lora-attn", model, 4)
    rng = random.Random(4)
    state, ref = _one_sequence(model, bypass, rng, 19)
    if remat != "all":
        state.keeps = new_keeps(model, 19, planned_keeps(executor_plan(model, bypass.config, "cheap"))
                                if remat == "cheap" else ())
    for size in _windows(rng, 19):
        forward_window(model, bypass, state, size, 1.0 / 18)
    while not state.finished:
        backward_window(model, bypass, state, rng.choice(_windows(rng, 19)))
    for g, r in zip(_grads(bypass), ref):
        assert r.abs().max() > 0
        assert float((g - r).norm() / r.norm()) <= 1e-5


def test_dropout_masks_are_window_independent_and_change_gradients(model_factory):
    from coserve.peft.dropout import keep_mask
    pos = torch.arange(40)
    whole = keep_mask(7, pos, 16, 0.25, torch.float32)
    assert torch.equal(torch.cat([keep_mask(7, pos[:13], 16, 0.25, torch.float32),
                                  keep_mask(7, pos[13:], 16, 0.25, torch.float32)]), whole)
    assert 0.6 < (whole > 0).float().mean() < 0.9
    assert whole.unique().tolist() == [0.0, torch.tensor(1 / 0.75).item()]
    assert not torch.equal(keep_mask(8, pos, 16, 0.25, torch.float32), whole)
    model = load_model(model_factory("llama"), torch.float32, torch.device("cpu"))
    grads = []
    for p in (0.0, 0.3):
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=p, target_modules=["down_proj"])
        bypass = TrainableLora(cfg, model.module_shapes(), model.cfg.num_layers, model.device,
                               torch.Generator().manual_seed(0))
        with torch.no_grad():
            for t in bypass.parameters():
                t.add_(0.1)
        ids = list(range(5, 25))
        whole_sequence_loss(model, bypass, ids, ids[1:] + [IGNORE_INDEX]).backward()
        grads.append(bypass.parameters()[0].grad.clone())
    assert not torch.allclose(grads[0], grads[1])


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("kind", ["lora-attn", "lora-mlp"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral:window=8"])
def test_kept_attention_output_backward_matches_autograd_on_the_device(model_factory, config_variant, device, kind,
                                                                       arch):
    """Attention's output and log-sum-exp kept (the device's kernel pair), everything else recomputed (on Qwen3
    the per-head q/k norms' backward too; on a Mistral sliding over 8 positions, under the window's mask)."""
    path = config_variant("mistral", sliding_window=8) if ":window=" in arch else model_factory(arch)
    model = load_model(path, torch.float32, torch.device(device))
    rng = random.Random(3)
    bypass = _bypass(kind, model, 3)
    state, ref = _one_sequence(model, bypass, rng, 29)
    state.keeps = new_keeps(model, 29, ("attn.o", "attn.lse"))
    for size in _windows(rng, 29):
        forward_window(model, bypass, state, size, 1.0 / 28)
    while not state.finished:
        backward_window(model, bypass, state, rng.choice(_windows(rng, 29)))
    for g, r in zip(_grads(bypass), ref):
        assert float((g - r).norm() / r.norm()) <= 1e-5


@pytest.mark.parametrize("remat", ["cheap", "all"])
@pytest.mark.parametrize("peft", [
    LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"]),
    LoraConfig(r=4, lora_alpha=8, target_modules=["up_proj"]),
    LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"]),
    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]),
    IA3Config(target_modules=["down_proj"], feedforward_modules=["down_proj"]),
], ids=["down", "up", "o", "q", "ia3-down-input"])
def test_the_first_layer_stops_at_its_lowest_bypass(model_factory, peft, remat):
    """Layer 0's input needs no gradient: its backward stops after the lowest bypassed module, and every
    gradient still matches one whole-sequence autograd backward."""
    model = load_model(model_factory("llama"), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    if isinstance(peft, IA3Config):
        bypass = TrainableIA3(peft, model.module_shapes(), model.cfg.num_layers, model.device)
    else:
        bypass = TrainableLora(peft, model.module_shapes(), model.cfg.num_layers, model.device, gen)
    with torch.no_grad():
        for p in bypass.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    rng = random.Random(5)
    state, ref = _one_sequence(model, bypass, rng, 21)
    if remat == "cheap":
        state.keeps = new_keeps(model, 21, planned_keeps(executor_plan(model, bypass.config, "cheap")))
    for size in _windows(rng, 21):
        forward_window(model, bypass, state, size, 1.0 / 20)
    before = state.grad.clone()
    while not state.finished:
        if state.backward_layer == 0 and state.backward_end == 21:
            before = state.grad.clone()
        backward_window(model, bypass, state, rng.choice(_windows(rng, 21)))
    assert torch.equal(state.grad, before)  # no input gradient was computed for layer 0
    for g, r in zip(_grads(bypass), ref):
        assert r.abs().max() > 0
        assert float((g - r).norm() / r.norm()) <= 1e-5


def test_the_backward_reads_the_norms_statistics_the_forward_kept(model_factory):
    """The plan stores each norm's per-row statistic: the forward windows write the very values that
    ``rms_norm_stats`` gives for the layer's input, and the backward windows dispatch no reduction for them
    (no ``rsqrt``), with gradients still those of one whole-sequence autograd backward."""

    class Rsqrts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket is torch.ops.aten.rsqrt
            return func(*args, **(kwargs or {}))

    model = load_model(model_factory("llama"), torch.float32, torch.device("cpu"))
    bypass = _bypass("lora-mlp", model, 9)
    rng = random.Random(9)
    state, ref = _one_sequence(model, bypass, rng, 23)
    names = planned_keeps(executor_plan(model, bypass.config, "cheap"))
    assert {"rms_attn", "rms_mlp"} <= names
    state.keeps = new_keeps(model, 23, names)
    for size in _windows(rng, 23):
        forward_window(model, bypass, state, size, 1.0 / 22)
    for layer, keep in enumerate(state.keeps):
        assert keep.base["rms_attn"].dtype == torch.float32
        assert torch.equal(keep.base["rms_attn"], rms_norm_stats(state.layer_inputs[layer], model.cfg.rms_norm_eps)[1])
    rsqrts = Rsqrts()
    with rsqrts:
        while not state.finished:
            backward_window(model, bypass, state, rng.choice(_windows(rng, 23)))
    assert rsqrts.count == 0
    for g, r in zip(_grads(bypass), ref):
        assert float((g - r).norm() / r.norm()) <= 1e-5


def test_the_kept_output_kernels_refuse_capped_scores():
    """Gemma 2's capped scores have no kept-output backward: its plan keeps no attention output, and the kernels
    refuse a capped layer rather than attend without the cap."""
    from coserve.finetune.window_attention import window_attention_backward, window_attention_lse
    from coserve.model.attention_spec import AttentionSpec
    q, k = torch.randn(3, 2, 8), torch.randn(5, 1, 8)
    capped = AttentionSpec(0.3, window=4, softcap=2.0)
    with pytest.raises(ValueError, match="window_attention_lse: the kernels keep no capped attention"):
        window_attention_lse(q, k, k, capped)
    out, lse = window_attention_lse(q, k, k, AttentionSpec(0.3, window=4))
    with pytest.raises(ValueError, match="window_attention_backward: the kernels keep no capped attention"):
        window_attention_backward(out, q, k, k, out, lse, capped)


@pytest.mark.parametrize("window", [None, 4])
def test_the_kept_output_kernels_carry_sinks_as_autograd_does(window):
    """gpt-oss's sinks on the kernels: the output scaled by ``sigmoid(lse - sink)``, and the backward from the kept
    output and log-sum-exp alone, equal to autograd through the written-out attention with its sink column (queries
    after a prefix, grouped K/V heads, with and without a sliding window)."""
    from coserve.finetune.window_attention import window_attention, window_attention_backward, window_attention_lse
    from coserve.model.attention_spec import AttentionSpec
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64).float().requires_grad_()
               for shape in ((5, 4, 8), (9, 2, 8), (9, 2, 8)))
    spec = AttentionSpec(0.35, window=window, sinks=(0.5, -1.0, 2.0, 0.0))
    ref = window_attention(q, k, v, spec)  # explicit_attention: the sink a softmax column
    dout = torch.randn(ref.shape, generator=gen)
    dq, dk, dv = torch.autograd.grad(ref, (q, k, v), dout)
    with torch.no_grad():
        out, lse = window_attention_lse(q, k, v, spec)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(out, window_attention_lse(q, k, v, AttentionSpec(0.35, window=window))[0])
        for got, want in zip(window_attention_backward(dout, q, k, v, out, lse, spec), (dq, dk, dv)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
