"""Bad input: a clear error naming the file or field, raised before any work; the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from coserve import LLM, SamplingParams
from coserve.model.config import ModelConfigError
from coserve.model.tokenizer import TokenizerLoadError
from coserve.model.weights import WeightLoadError
from coserve.peft import AdapterError
from peft_helpers import make_lora_adapter


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(model_factory, tmp_path):
    d = _copy(model_factory("llama"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="architectures.*GPTNeoXForCausalLM"):
        LLM(d, device="cpu")


@pytest.mark.parametrize("arch,change", [
    ("qwen3", {"sliding_window": 64, "use_sliding_window": False}),  # the released settings: every layer full
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2, "layer_types": None}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1, "layer_types": None}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0, "layer_types": None}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64,
               "layer_types": ["full_attention", "sliding_attention"]}),
    ("qwen3", {"use_sliding_window": False, "sliding_window": 64,
               "layer_types": ["full_attention", "sliding_attention"]}),
    ("mistral", {"sliding_window": 64}),
    ("mistral", {"sliding_window": None}),
    ("mistral", {"sliding_window": "absent"}),  # transformers' default window, 4,096
    ("phi3", {"sliding_window": 64}),
    ("phi3", {}),
    ("llama", {}),
])
def test_the_sliding_window_is_read_as_transformers_reads_it(model_factory, arch, change):
    """``ModelConfig.attention_windows``: each layer's window where it slides in transformers' own model of the config
    (its ``layer_types``, or Mistral's and Phi-3's every layer), None where it does not; the context is not capped
    by it (coserve attends within the window); ``kv_window`` where every layer slides."""
    from transformers import AutoConfig

    from coserve.model.config import ModelConfig
    raw = {**json.loads((model_factory(arch) / "config.json").read_text()), **change}
    if raw.get("sliding_window") == "absent":
        del raw["sliding_window"]
    hf = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    kinds = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    slides = getattr(hf, "sliding_window", None) is not None and "sliding_attention" in kinds
    cfg = ModelConfig.from_dict(raw)
    assert cfg.sliding_window == (hf.sliding_window if slides else None)
    assert [cfg.attention_window(i) for i in range(cfg.num_layers)] == [
        hf.sliding_window if slides and kind == "sliding_attention" else None for kind in kinds]
    # the KV blocks behind a window are freed only where every layer slides
    assert cfg.kv_window == (hf.sliding_window if slides and set(kinds) == {"sliding_attention"} else None)


@pytest.mark.parametrize("arch, field", [("llama", "attention_bias"), ("olmo3", "attention_bias"),
                                         ("seed_oss", "attention_out_bias"), ("llama", "mlp_bias"),
                                         ("seed_oss", "mlp_bias")])
def test_biases_the_layers_do_not_add_are_refused_by_field(model_factory, arch, field):
    """A bias on the attention's output projection (the ``attention_bias`` of Llama, OLMo 3 and others puts one there
    too) or on the MLP would be left out of the forward: such a config is refused, naming the field, not served
    wrong."""
    from coserve.model.config import ModelConfig
    raw = json.loads((model_factory(arch) / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=f"field '{field}'"):
        ModelConfig.from_dict({**raw, field: True})
    assert ModelConfig.from_dict({**raw, field: False}).qkv_bias == (arch == "seed_oss")


def test_olmo3s_two_ropes_read_alike_in_either_spelling(model_factory):
    """OLMo 3's config nests each kind of layer's RoPE in transformers 5 (``rope_parameters`` by kind); in 4.x
    spelling ``rope_scaling`` is the full layers' alone and both kinds share ``rope_theta``: the same model either
    way, the sliding layers' RoPE plain."""
    from coserve.model.config import ModelConfig
    raw = json.loads((model_factory("olmo3") / "config.json").read_text())
    full = raw["rope_parameters"]["full_attention"]
    old = {**{k: v for k, v in raw.items() if k != "rope_parameters"}, "rope_theta": full["rope_theta"],
           "rope_scaling": {k: v for k, v in full.items() if k != "rope_theta"}}
    new, legacy = ModelConfig.from_dict(raw), ModelConfig.from_dict(old)
    assert new.rope == legacy.rope and new.rope.rope_type == "yarn"
    assert new.rope_local == legacy.rope_local and new.rope_local.rope_type == "default"


def test_layers_of_other_kinds_are_refused_by_field(model_factory):
    from coserve.model.config import ModelConfig
    raw = json.loads((model_factory("qwen3") / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="layer_types.*layer 1 is 'chunked_attention'"):
        ModelConfig.from_dict({**raw, "use_sliding_window": True, "sliding_window": 64,
                               "layer_types": ["full_attention", "chunked_attention"]})
    with pytest.raises(ModelConfigError, match="sliding_window must be positive"):
        ModelConfig.from_dict({**json.loads((model_factory("mistral") / "config.json").read_text()),
                               "sliding_window": -4})


def test_missing_and_corrupt_weights(model_factory, tmp_path):
    d = _copy(model_factory("llama"), tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        LLM(d, device="cpu")
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        LLM(d, device="cpu")


@pytest.mark.parametrize("arch,tensor", [("llama", "model.layers.1.mlp.up_proj.weight"),
                                         ("qwen3", "model.layers.0.self_attn.k_norm.weight")])
def test_missing_tensor_is_named(model_factory, tmp_path, arch, tensor):
    from safetensors.torch import load_file, save_file
    d = _copy(model_factory(arch), tmp_path)
    state = load_file(str(d / "model.safetensors"))
    del state[tensor]
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=tensor):
        LLM(d, device="cpu")


def test_tokenizer_that_does_not_load(model_factory, tmp_path):
    d = _copy(model_factory("llama"), tmp_path)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="tokenizer"):
        LLM(d, device="cpu")


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", device="cpu", max_model_len=64)


def test_adapter_that_does_not_fit(llm, model_factory, tmp_path):
    other = model_factory("llama")
    path = make_lora_adapter(other, tmp_path / "ok", r=4, lora_alpha=8, target_modules=["q_proj"])
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "lm_head"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="target_modules.*lm_head"):
        llm.load_adapter("bad", path)
    cfg["target_modules"] = ["q_proj"]
    for alpha in (float("nan"), float("inf"), True, "8"):  # Python's json reads NaN and Infinity: NaN outputs
        (path / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": alpha}))
        with pytest.raises(AdapterError, match="'lora_alpha' must be a finite number"):
            llm.load_adapter("bad", path)
    from safetensors.torch import load_file, save_file
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="shape"):
        llm.load_adapter("bad", path)
    with pytest.raises(AdapterError, match="adapter_config.json"):
        llm.load_adapter("bad", tmp_path / "nowhere")


def test_bad_requests_fail_before_any_work_and_the_engine_keeps_serving(llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine = llm.engine
    engine.add_request("a request already running", SamplingParams(max_tokens=6, temperature=0,
                                                                   ignore_eos=True), request_id="ok")
    engine.step()
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("word " * 100, params)
    with pytest.raises(ValueError, match="adapter.*nope"):
        engine.add_request("hi", params, adapter="nope")
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 10**9], params)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate(["fine", "word " * 100], params)
    # each of these used to reach the model and fail the whole iteration, the running request's token with it
    vocab = engine.model_config.vocab_size
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{field}: {vocab + 1} is more than the vocabulary"):
            engine.add_request("hi", SamplingParams(max_tokens=2, **{field: vocab + 1}))
        with pytest.raises(ValueError, match=rf"^{field} must be"):
            SamplingParams(**{field: True})
    with pytest.raises(ValueError, match="^top_k must be"):
        SamplingParams(top_k=True)
    with pytest.raises(ValueError, match="^prompt: holds an unpaired UTF-16 surrogate"):  # the tokenizer's TypeError
        engine.add_request("a \ud800 b", params)
    for prompts in (None, 5, b"bytes"):
        with pytest.raises(ValueError, match="^prompts: a string, a list of token ids"):
            llm.generate(prompts, params)
    assert set(engine.scheduler.requests) == {"ok"}  # nothing half-queued
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"] and len(done[0].token_ids) == 6


def test_abort_returns_a_final_output(llm):
    engine = llm.engine
    engine.add_request("to be aborted", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                       request_id="gone")
    engine.step()
    engine.abort_request("gone")
    outs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [("gone", True, "abort")]


def test_a_rank_too_large_to_allocate_names_r_and_other_faults_stay_themselves(llm, monkeypatch):
    """``make_bypass``: torch failing to allocate a LoRA of that rank is a ValueError naming ``r``; any other
    RuntimeError while building it is not dressed up as one."""
    from coserve.finetune import build
    from coserve.peft.config import LoraConfig

    model = llm.engine.model
    with pytest.raises(ValueError, match=r"^r: a rank-\d+ LoRA on q_proj .* cannot be allocated"):
        build.make_bypass(LoraConfig(r=10**12, lora_alpha=16, target_modules=["q_proj"]), model, 0)

    def broken(*args, **kwargs):
        raise RuntimeError("an unrelated fault")
    monkeypatch.setattr(build, "TrainableLora", broken)
    with pytest.raises(RuntimeError, match="an unrelated fault"):
        build.make_bypass(LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"]), model, 0)
