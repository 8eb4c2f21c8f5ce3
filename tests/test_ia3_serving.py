"""Serving IA3 adapters, with HF PEFT as the oracle: alone, and mixed per token with LoRA and the base model."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from coserve import LLM, SamplingParams
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.mixed_forward import FinetuneSlice, mixed_forward
from coserve.finetune.build import make_bypass
from coserve.finetune.sequence_state import IGNORE_INDEX, new_sequence_state
from coserve.model.attention import PagedKVCache
from coserve.model.decoder import BATCH_INVARIANT_ROWS
from coserve.model.forward_batch import SequenceChunk, build_forward_batch
from coserve.peft import AdapterError, IA3Adapter, MixedAdapterBatch
from coserve.peft.config import IA3Config, LoraConfig
from peft_helpers import hf_greedy, make_coserve_ia3_adapter, make_ia3_adapter, make_lora_adapter, peft_model

PROMPTS = ["The quick brown fox", "def add(a, b):", "A", "Scheduling decides which tokens run",
           "JSON: {\"key\": [1, 2", "Once upon", "Paged attention reads blocks", "x = [i * i for i in"]
# float32 against PEFT on the same weights: the fused q/k/v and gate/up matmuls round differently from
# PEFT's separate ones, so logits agree to float32 rounding, not bitwise (measured below 1e-5).
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Per model: ``peft_ia3`` (PEFT's default placement, made by PEFT), ``coserve_ia3`` (made by coserve's
    TrainableIA3, scaling q/k/gate/up/down outputs and the o_proj input) and ``lora`` (q/v, non-zero B)."""
    made = {}

    def get(model_dir):
        if model_dir not in made:
            root = tmp_path_factory.mktemp("adapters")
            made[model_dir] = {
                "peft_ia3": make_ia3_adapter(model_dir, root / "peft_ia3", seed=1),
                "coserve_ia3": make_coserve_ia3_adapter(
                    model_dir, root / "coserve_ia3", seed=2,
                    target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                    feedforward_modules=["o_proj"]),
                "lora": make_lora_adapter(model_dir, root / "lora", seed=3, r=8, lora_alpha=16,
                                          target_modules=["q_proj", "v_proj", "down_proj"]),
            }
        return made[model_dir]

    return get


def _check_logprobs(out, oracle, atol: float = LOGPROB_ATOL) -> None:
    """Every step's top logprobs against the oracle's log-softmax over the prompt plus the tokens so far."""
    ids = out.prompt_token_ids + out.token_ids
    with torch.inference_mode():
        ref = oracle(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1:-1].float().log_softmax(-1)
    for step, lp in enumerate(out.outputs[0].logprobs):
        for token, value in lp.top.items():
            assert abs(value - ref[step, token].item()) <= atol, (step, token, value, ref[step, token].item())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ia3_generation_matches_peft(model_factory, hf_model_cache, adapters, arch):
    model_dir = model_factory(arch)
    paths = adapters(model_dir)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=11)
    for name in ("peft_ia3", "coserve_ia3"):
        llm.load_adapter(name, paths[name])
    assert isinstance(llm.engine.adapters["coserve_ia3"], IA3Adapter)
    which = ["peft_ia3", "coserve_ia3", None, "coserve_ia3", "peft_ia3", "coserve_ia3"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS[:6], params, adapter=which)
    oracles = {None: hf_model_cache(model_dir), **{n: peft_model(model_dir, paths[n]) for n in which if n}}
    differs = 0
    for out, name in zip(outs, which):
        assert out.token_ids == hf_greedy(oracles[name], out.prompt_token_ids, 16), (name, out.prompt)
        _check_logprobs(out, oracles[name])
        if name is not None:
            differs += out.token_ids != hf_greedy(oracles[None], out.prompt_token_ids, 16)
    assert differs >= 3, "the IA3 adapters should change the outputs"


def test_prefill_logits_of_a_mixed_batch_match_peft(model_factory, hf_model_cache, adapters):
    """All-position logits of one flat forward whose sequences use the base, LoRA and two IA3 adapters."""
    model_dir = model_factory("qwen2")  # q/k/v biases: an output scale multiplies them too
    paths = adapters(model_dir)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    for name, path in paths.items():
        engine.load_adapter(name, path)
    which = [None, "peft_ia3", "lora", "coserve_ia3", "peft_ia3"]
    ids = [engine.tokenizer(p)["input_ids"] for p in PROMPTS[3:8]]
    chunks, row = [], 0
    for i, seq in enumerate(ids):
        chunks.append(SequenceChunk(row, row + len(seq), len(seq), [2 * i, 2 * i + 1]))
        row += len(seq)
    batch = build_forward_batch(ids, chunks, 8, list(range(row)), torch.device("cpu"))
    bypass = engine.executor.slots.batch([engine.adapters[n] for n in sorted(paths)],
                                         [(name, len(seq)) for name, seq in zip(which, ids)])
    assert isinstance(bypass, MixedAdapterBatch)
    c = engine.model.cfg
    cache = PagedKVCache(c.num_layers, 16, 8, c.num_kv_heads, c.head_dim, torch.device("cpu"), torch.float32)
    logits = engine.model.logits(engine.model.forward(batch, cache, bypass))
    for name, seq, chunk in zip(which, ids, chunks):
        oracle = peft_model(model_dir, paths[name]) if name else hf_model_cache(model_dir)
        with torch.inference_mode():
            ref = oracle(torch.tensor([seq])).logits[0].float()
        torch.testing.assert_close(logits[chunk.start:chunk.end], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_rows_match_each_row_alone(model_factory, hf_model_cache, adapters, arch):
    """Base rows, LoRA rows and the rows of two IA3 adapters in one batch: each as it runs alone, and as PEFT."""
    model_dir = model_factory(arch)
    paths = adapters(model_dir)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_loras=4)
    for name, path in paths.items():
        llm.load_adapter(name, path)
    which = [None, "lora", "peft_ia3", "coserve_ia3", "peft_ia3", None, "coserve_ia3", "lora"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    together = llm.generate(PROMPTS, params, adapter=which)
    assert llm.engine.last_plan.adapters == sorted(paths)  # the last decode step still held every kind
    oracles = {None: hf_model_cache(model_dir), **{n: peft_model(model_dir, p) for n, p in paths.items()}}
    for prompt, name, out in zip(PROMPTS, which, together):
        alone = llm.generate(prompt, params, adapter=name)[0]
        assert out.token_ids == alone.token_ids, (name, prompt)
        # the LM head runs over the sampling rows only (1 alone, 8 together): last-bit differences, no more
        for got, ref in zip(out.outputs[0].logprobs, alone.outputs[0].logprobs):
            assert got.top.keys() == ref.top.keys(), (name, prompt)
            assert max(abs(got.top[t] - ref.top[t]) for t in got.top) <= 1e-5, (name, prompt)
        assert out.token_ids == hf_greedy(oracles[name], out.prompt_token_ids, 12), (name, prompt)


@pytest.mark.parametrize("job", ["lora", "ia3"])
@pytest.mark.parametrize("num_inference", [3, 12])
def test_ia3_rows_beside_a_finetuning_window_are_bitwise_unchanged(model_factory, adapters, job, num_inference):
    """Co-serving: IA3 (and LoRA, and base) inference rows in the same forward call as a finetuning window."""
    model_dir = model_factory("llama")
    paths = adapters(model_dir)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    for name, path in paths.items():
        engine.load_adapter(name, path)
    model, c = engine.model, engine.model.cfg
    rng = random.Random(num_inference)
    tokens = [rng.randrange(5, c.vocab_size) for _ in range(num_inference)]
    rows = max(num_inference, BATCH_INVARIANT_ROWS)
    kinds = ["peft_ia3", "coserve_ia3", "lora", None]  # per token: every kind side by side
    runs = [(kinds[i % 4], 1) for i in range(num_inference)] + [(None, rows - num_inference)]
    bypass = engine.executor.slots.batch([engine.adapters[n] for n in sorted(paths)], runs)
    batch = build_forward_batch([tokens], [SequenceChunk(0, num_inference, num_inference, list(range(8)))],
                                4, [], model.device)
    alone = model.forward(batch, _cache(model), bypass, min_rows=rows)
    # the job's bypass touches down_proj too, whose input the IA3 rows scale
    config = (LoraConfig(r=4, target_modules=["v_proj", "down_proj"]) if job == "lora"
              else IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]))
    trainable = make_bypass(config, model, seed=0)
    ids = [rng.randrange(5, c.vocab_size) for _ in range(20)]
    state = new_sequence_state(ids, ids[1:] + [IGNORE_INDEX], c.num_layers, c.hidden_size, c.num_kv_heads,
                               c.head_dim, model.device, model.dtype)
    hidden, _ = mixed_forward(model, batch, _cache(model), bypass, FinetuneSlice(trainable, state, 9, 1 / 19),
                              adapter_rows=rows)
    assert torch.equal(hidden, alone)


def _cache(model):
    c = model.cfg
    return PagedKVCache(c.num_layers, 32, 4, c.num_kv_heads, c.head_dim, model.device, model.dtype)


def test_load_unload_and_replace_at_run_time(model_factory, adapters):
    """``max_loras`` bounds distinct adapters of either kind per batch; a name may change kind when reloaded."""
    model_dir = model_factory("llama")
    paths = adapters(model_dir)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_loras=1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    base = llm.generate(PROMPTS[0], params)[0].token_ids
    llm.load_adapter("ia3", paths["peft_ia3"])
    llm.load_adapter("lora", paths["lora"])
    # max_loras=1: the LoRA and IA3 requests of one call are served one after the other, slots swapped
    i, lo = llm.generate([PROMPTS[0], PROMPTS[0]], params, adapter=["ia3", "lora"])
    assert i.token_ids != base and lo.token_ids != base
    assert llm.generate(PROMPTS[0], params, adapter="ia3")[0].token_ids == i.token_ids
    llm.load_adapter("ia3", paths["lora"])  # the same name, now a LoRA adapter: its IA3 slot is dropped
    assert llm.generate(PROMPTS[0], params, adapter="ia3")[0].token_ids == lo.token_ids
    llm.load_adapter("ia3", paths["peft_ia3"])
    assert llm.generate(PROMPTS[0], params, adapter="ia3")[0].token_ids == i.token_ids
    llm.unload_adapter("ia3")
    with pytest.raises(ValueError, match="ia3"):
        llm.generate(PROMPTS[0], params, adapter="ia3")
    assert llm.generate(PROMPTS[0], params)[0].token_ids == base
    assert llm.engine.executor.slots.ia3.slot_of("ia3") is None



def _key(layer: int, module: str, kind: str = "ia3_l") -> str:
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj", "fc1") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.{kind}"


CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# (case, config fields to set, tensors to set (None: remove), the file the error names, what it says), on PEFT's
# default placement over the tiny Llama (hidden 64, k/v 32 wide, intermediate 176, 2 layers)
BAD_IA3 = [
    ("vector of the wrong length", {}, {_key(0, "k_proj"): torch.ones(31, 1)}, WEIGHTS, r"k_proj.*\(31, 1\)"),
    ("transposed vector", {}, {_key(0, "down_proj"): torch.ones(176, 1)}, WEIGHTS,
     r"down_proj.*feed-forward.*\(1, 176\)"),
    ("placement the shapes contradict", {"feedforward_modules": []}, {}, WEIGHTS,
     r"down_proj.*output scale.*feedforward_modules"),
    ("module the model lacks", {}, {_key(0, "fc1"): torch.ones(32, 1)}, WEIGHTS, "'fc1', which the model lacks"),
    ("config names a module the model lacks", {"target_modules": ["k_proj", "fc1"]}, {}, CONFIG,
     r"target_modules.*\['fc1'\]"),
    ("layer past the model", {}, {_key(7, "k_proj"): torch.ones(32, 1)}, WEIGHTS, "layer 7; the model has 2 layers"),
    ("missing vector", {}, {_key(1, "v_proj"): None}, WEIGHTS, "no ia3_l vector for layer 1 v_proj"),
    ("vector of a module the config does not list", {"target_modules": ["v_proj", "down_proj"]}, {}, WEIGHTS,
     "k_proj, which field 'target_modules'"),
    ("input scaling of a fused module", {"target_modules": ["k_proj", "v_proj", "gate_proj", "down_proj"],
                                         "feedforward_modules": ["gate_proj", "down_proj"]},
     {_key(0, "gate_proj"): torch.ones(1, 64)}, CONFIG, "feedforward_modules.*gate_proj input-scaled"),
    ("a LoRA tensor", {}, {_key(0, "k_proj", "lora_A.weight"): torch.ones(4, 64)}, WEIGHTS, "not an IA3 vector"),
    ("integer vector", {}, {_key(0, "k_proj"): torch.ones(32, 1, dtype=torch.int32)}, WEIGHTS, "dtype"),
    ("fan_in_fan_out", {"fan_in_fan_out": True}, {}, CONFIG, "fan_in_fan_out"),
    ("unknown peft_type", {"peft_type": "PREFIX_TUNING"}, {}, CONFIG, "peft_type.*LORA and IA3"),
]


@pytest.fixture(scope="module")
def llama_llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", device="cpu")


@pytest.mark.parametrize("case, fields, changes, named, says", BAD_IA3, ids=[c[0] for c in BAD_IA3])
def test_bad_ia3_files_are_refused_naming_the_file(llama_llm, model_factory, adapters, tmp_path,
                                                   case, fields, changes, named, says):
    path = shutil.copytree(adapters(model_factory("llama"))["peft_ia3"], tmp_path / "bad")
    config = json.loads((path / CONFIG).read_text())
    (path / CONFIG).write_text(json.dumps({**config, **fields}))
    tensors = load_file(str(path / WEIGHTS))
    for key, value in changes.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    save_file(tensors, str(path / WEIGHTS))
    with pytest.raises(AdapterError, match=says) as e:
        llama_llm.load_adapter("bad", path)
    assert str(e.value).startswith(str(path / named)), str(e.value)
    assert "bad" not in llama_llm.engine.adapters
    assert llama_llm.generate("Hi", SamplingParams(max_tokens=2))[0].token_ids  # still serving


def test_missing_and_corrupt_ia3_files(llama_llm, model_factory, adapters, tmp_path):
    path = shutil.copytree(adapters(model_factory("llama"))["peft_ia3"], tmp_path / "a")
    (path / WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match=re.escape(f"{path / WEIGHTS}: cannot read")):
        llama_llm.load_adapter("bad", path)
    (path / WEIGHTS).unlink()
    with pytest.raises(AdapterError, match=re.escape(f"{path / WEIGHTS}: missing")):
        llama_llm.load_adapter("bad", path)
    (path / CONFIG).unlink()
    with pytest.raises(AdapterError, match=re.escape(f"{path / CONFIG}: no {CONFIG}")):
        llama_llm.load_adapter("bad", path)
