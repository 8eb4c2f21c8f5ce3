"""HF PEFT is the oracle: the same starting adapter, examples and optimizer give the same adapter and losses."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
import torch.nn.functional as F

from coserve.finetune.config import FinetuneConfig
from coserve.finetune.job import Example, FinetuneJob
from coserve.finetune.runner import run_job
from coserve.finetune.sequence_state import IGNORE_INDEX
from coserve.model.loader import load_model
from coserve.peft.trainable import load_model_trainable
from model_variants import phi3_longrope, yarn_variant
from peft_helpers import PeftTraining, make_dora_adapter, make_ia3_adapter, make_lora_adapter


def _examples(vocab: int, n: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [0] + [rng.randrange(5, vocab) for _ in range(rng.randint(6, 20))]
        prompt = rng.randint(1, len(ids) - 2)
        targets = [IGNORE_INDEX] * (prompt - 1) + ids[prompt:] + [IGNORE_INDEX]  # loss on the completion only
        out.append(Example(ids, targets))
    return out


def _greedy_halves(model_dir, adapter_dir, examples: list[Example]) -> list[Example]:
    """Every other example's completion replaced by the starting model's greedy continuation of its prompt, so
    that token accuracy is far from zero (random weights predict random tokens otherwise)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                                     str(adapter_dir))
    out = []
    for i, e in enumerate(examples):
        if i % 2:
            prompt = next(j for j, t in enumerate(e.targets) if t != IGNORE_INDEX) + 1
            n = len(e.token_ids) - prompt
            ids = base.generate(torch.tensor([e.token_ids[:prompt]]), do_sample=False, min_new_tokens=n,
                                max_new_tokens=n, pad_token_id=0)[0].tolist()
            e = Example(ids, [IGNORE_INDEX] * (prompt - 1) + ids[prompt:] + [IGNORE_INDEX])
        out.append(e)
    return out


def _peft_train(model_dir, adapter_dir, examples, cfg: FinetuneConfig, steps: int):
    peft = PeftTraining(model_dir, adapter_dir, cfg, steps)
    losses, accuracies = [], []
    for step in range(steps):
        batch = examples[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        total = sum(sum(t != IGNORE_INDEX for t in e.targets) for e in batch)
        loss, correct = 0, 0
        for e in batch:
            logits = peft.model(input_ids=torch.tensor([e.token_ids])).logits[0]
            targets = torch.tensor(e.targets)
            loss = loss + F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") / total
            correct += int((logits.argmax(-1) == targets).sum())  # IGNORE_INDEX is never an argmax
        losses.append(peft.step(loss))
        accuracies.append(correct / total)
    return losses, accuracies, peft.state()


@pytest.mark.parametrize("optimizer,tol", [("sgd", 1e-5), ("adamw", 1e-4)])
@pytest.mark.parametrize("arch,targets", [("llama", ["down_proj"]),
                                          ("llama", ["q_proj", "v_proj", "o_proj", "gate_proj"]),
                                          ("qwen2", "ia3"), ("qwen2", "dora"),
                                          ("qwen3", ["q_proj", "k_proj", "v_proj", "down_proj"]),
                                          ("phi3", ["qkv_proj", "gate_up_proj"]), ("phi3", "ia3"),
                                          ("phi3", "dora"), ("phi3:longrope", ["qkv_proj", "o_proj"]),
                                          ("qwen3:yarn", ["q_proj", "k_proj", "v_proj"]),
                                          ("mistral:window=8", ["q_proj", "k_proj", "v_proj"]),
                                          ("gemma3", ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]),
                                          ("gemma3", "ia3"), ("gemma2", ["q_proj", "v_proj", "gate_proj", "down_proj"]),
                                          ("granite", ["q_proj", "o_proj", "up_proj", "down_proj"]),
                                          ("smollm3", ["q_proj", "k_proj", "v_proj", "down_proj"]),
                                          ("olmo2", ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]),
                                          ("olmo2", "ia3"), ("olmo3", ["q_proj", "k_proj", "v_proj", "down_proj"]),
                                          ("seed_oss", ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]),
                                          ("mixtral", ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                          ("qwen3_moe", ["q_proj", "v_proj"]),
                                          ("olmoe", ["q_proj", "k_proj", "o_proj"]),
                                          ("qwen2_moe", ["q_proj", "v_proj", "o_proj"]),
                                          ("glm4_moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                          ("gpt_oss", ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                          ("gpt_oss", {"target_modules": ["o_proj"], "target_parameters":
                                                       ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}),
                                          ("glm4_moe", {"target_modules": ["gate", "k_proj"],
                                                        "target_parameters": ["gate_up_proj", "down_proj"]}),
                                          ("mixtral", {"target_modules": ["q_proj"], "target_parameters":
                                                       ["experts.gate_up_proj", "experts.down_proj"]}),
                                          ("qwen2_moe", {"target_modules": [], "target_parameters": ["down_proj"]}),
                                          ("olmoe", {"target_modules": ["v_proj"],
                                                     "target_parameters": ["experts.gate_up_proj"]}),
                                          ("qwen3_moe", {"target_modules": "all-linear"}),
                                          ("qwen2_moe", {"target_modules": "all-linear"})])
def test_training_matches_peft(model_factory, config_variant, tmp_path, optimizer, tol, arch, targets):
    """``mistral:window=8``: every layer slides over 8 positions, shorter than most training sequences;
    ``phi3:longrope``: LongRoPE's original context is 14 tokens, so that some sequences rotate by its long factors
    (each by its own length, as PEFT's forward of a batch of one); ``qwen3:yarn``: YaRN over an original context
    of 8."""
    model_dir = (config_variant("mistral", sliding_window=8) if ":window=" in arch
                 else phi3_longrope(config_variant, original=14) if arch == "phi3:longrope"
                 else yarn_variant(model_factory, config_variant, "qwen3", original=8) if arch == "qwen3:yarn"
                 else model_factory(arch))
    phi3 = arch.startswith("phi3")  # Phi-3's fused modules: one bypass over all of q, k and v, one over gate and up
    if targets == "ia3":  # PEFT's default IA3 placement: k_proj and v_proj outputs, down_proj input
        placement = ({"target_modules": ["qkv_proj", "down_proj"], "feedforward_modules": ["down_proj"]} if phi3 else
                     {"target_modules": ["k_proj", "v_proj", "down_proj"], "feedforward_modules": ["down_proj"]}
                     if arch == "olmo2" else {})  # PEFT has no default placement for these
        start = make_ia3_adapter(model_dir, tmp_path / "start", seed=3, **placement)
    elif targets == "dora":  # q/v with Qwen2's biases, which DoRA leaves unscaled
        start = make_dora_adapter(model_dir, tmp_path / "start", seed=3, r=4, lora_alpha=8,
                                  target_modules=["qkv_proj", "gate_up_proj"] if phi3 else
                                  ["q_proj", "v_proj", "up_proj", "down_proj"])
    else:  # a dict: a mixture's experts too (PEFT's target_parameters)
        kwargs = targets if isinstance(targets, dict) else {"target_modules": targets}
        start = make_lora_adapter(model_dir, tmp_path / "start", seed=3, r=4, lora_alpha=8, **kwargs)
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    examples = _greedy_halves(model_dir, start, _examples(model.cfg.vocab_size, 6, seed=5))
    if model.long_rope_from is not None:  # sequences on both sides of the original context
        assert {len(e.token_ids) > model.long_rope_from for e in examples} == {True, False}
    steps = 3
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), batch_size=2, lr=0.05 if optimizer == "sgd" else 0.01,
                         optimizer=optimizer, warmup_steps=1, lr_scheduler="linear", max_grad_norm=1.0,
                         weight_decay=0.01, shuffle=False, window_schedule="random:7")
    bypass = load_model_trainable(start, model)
    job = FinetuneJob(model, bypass, examples, cfg, base_model=str(model_dir))
    run_job(job, progress=False)
    ref_losses, ref_accuracies, ref_state = _peft_train(model_dir, start, examples, cfg, steps)

    assert [r.loss for r in job.log] == pytest.approx(ref_losses, abs=1e-4)
    assert [r.accuracy for r in job.log] == ref_accuracies and max(ref_accuracies) > 0
    ours = bypass.state_dict()
    assert set(ours) == set(ref_state)
    for name, ref in ref_state.items():
        rel = (ours[name] - ref).norm() / ref.norm()
        assert rel <= tol, (name, float(rel))
    # the saved adapter is what PEFT loads, with the same outputs
    saved = load_model_trainable(cfg.output_dir, model)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(tensor, ours[name])
    lines = [json.loads(x) for x in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert set(lines[0]) >= {"step", "loss", "lr", "tokens", "elapsed_s", "mean_token_accuracy"}
    assert [x["mean_token_accuracy"] for x in lines] == ref_accuracies


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_all_linear_wraps_the_modules_peft_wraps(model_factory, arch):
    """PEFT's target_modules="all-linear" (every linear module but the LM head: Phi-3's fused qkv_proj and
    gate_up_proj), as a string, a one-item list or the CLI's comma list, resolved against the model; any other string
    is refused rather than read as PEFT's path regex, and so is a module the model lacks."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from coserve.model.loader import load_model
    from coserve.peft.config import LoraConfig, for_model
    path = model_factory(arch)
    hf = get_peft_model(AutoModelForCausalLM.from_pretrained(str(path)),
                        PeftLoraConfig(r=4, target_modules="all-linear"))
    wrapped = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in hf.named_parameters()
               if name.endswith("lora_A.default.weight")}
    modules = load_model(path, torch.float32, torch.device("cpu")).module_shapes()
    for given in ("all-linear", ["all-linear"]):
        assert set(for_model(LoraConfig(target_modules=given), modules).target_modules) == wrapped
    lacking = ["q_proj", "v_proj"] if arch == "phi3" else ["qkv_proj"]
    with pytest.raises(ValueError, match=re.escape(f"target_modules: {lacking!r} are not modules of this model")):
        for_model(LoraConfig(target_modules=lacking), modules)
    with pytest.raises(ValueError, match="a string must be 'all-linear'"):
        LoraConfig(target_modules=".*proj")
