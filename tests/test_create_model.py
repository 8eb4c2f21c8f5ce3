"""``create_model`` writes real HF model directories; ``build_tokenizer`` a real byte-level BPE tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from coserve.model.create import build_config, create_model
from coserve.model.presets import PRESETS
from coserve.model.tokenizer_builder import SPECIAL_TOKENS, THINK_TOKENS, build_tokenizer

ARCHS = ("llama", "qwen2", "mistral", "qwen3")
# Same arguments as the parity test in test_model_parity.py, so the session cache makes it once.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}
TEXTS = ["Hello, world!", "  leading spaces\tand tabs\n\nnewlines ", "héllo wörld — naïve café",
         "日本語のテキスト 🚀🔥 emoji", "def f(x):\n    return {'a': [1, 2.5e-3]}\n", "\x00\x7f control", ""]


def _weights(path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_in_transformers_with_expected_shapes(model_factory, arch):
    path = model_factory(arch)
    assert (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").exists()
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg, p = model.config, PRESETS["tiny"]
    assert cfg.model_type == arch and cfg.num_hidden_layers == 2 and cfg.vocab_size == p.vocab_size
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)  # GQA
    assert not cfg.tie_word_embeddings and cfg.max_position_embeddings == 512
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (64, 64)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (32, 64)
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (176, 64)
    assert model.lm_head.weight.shape == (p.vocab_size, 64)
    has_bias = arch == "qwen2"
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert (proj.bias is not None) == has_bias
    assert attn.o_proj.bias is None
    if arch == "mistral":
        assert cfg.sliding_window is None
    if arch in ("qwen2", "qwen3"):
        assert not cfg.use_sliding_window and set(cfg.layer_types) == {"full_attention"}
    if arch == "qwen3":  # per-head norms of q and k, set to two different ramps
        assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (16,)
        assert torch.equal(attn.q_norm.weight, torch.linspace(0.5, 1.5, 16))
        assert torch.equal(attn.k_norm.weight, torch.linspace(0.5, 1.5, 16).flip(0))
    else:
        assert not hasattr(attn, "q_norm")
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 4] and gen["bos_token_id"] == 0 and gen["pad_token_id"] == 2
    raw = json.loads((path / "config.json").read_text())
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]) == (0, 1, 2)
    assert raw["dtype"] == "float32"


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_are_spread_out_for_stable_greedy_decoding(model_factory, hf_model_cache, arch):
    path = model_factory(arch)
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok("Scheduling decides which tokens run in every iteration")["input_ids"]
    with torch.inference_mode():
        logits = hf_model_cache(path)(torch.tensor([ids])).logits[0]
    assert 2.0 < logits.std(dim=-1).mean().item() < 4.5
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-4  # no near-ties on this prompt
    assert len(set(logits.argmax(-1).tolist())) > 1  # the prediction depends on the context


def test_tokenizer_loads_adds_bos_and_round_trips(model_factory):
    tok = AutoTokenizer.from_pretrained(str(model_factory("llama")))
    assert len(tok) == PRESETS["tiny"].vocab_size
    assert tok.convert_ids_to_tokens(list(range(5))) == list(SPECIAL_TOKENS)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [3, 4]
    assert tok.model_max_length == 512
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids) == "<|begin_of_text|>" + text
    assert tok("<|im_start|>user")["input_ids"][:2] == [0, 3]  # special tokens are single tokens
    # reasoning tags: the vocabulary's last two ids, whole tokens that decoding keeps (as Qwen3's)
    think = tok("<think>Add them.</think>4")["input_ids"]
    assert think[1] == PRESETS["tiny"].vocab_size - 2 and PRESETS["tiny"].vocab_size - 1 in think
    assert tok.decode(think, skip_special_tokens=True) == "<think>Add them.</think>4"
    assert len(tok("the function returns the value")["input_ids"]) < 12  # merges were learned


def test_chat_template_renders_chatml(model_factory):
    tok = AutoTokenizer.from_pretrained(str(model_factory("qwen2")))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tokenize=False).endswith("Hi<|im_end|>\n")
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == 3 and ids.count(4) == 2 and tok.decode(ids) == text


def test_build_tokenizer_is_deterministic_and_sized():
    a, b = build_tokenizer(1024), build_tokenizer(1024)
    assert a is not b and a.to_str() == b.to_str()
    big = build_tokenizer(8192)
    assert big.get_vocab_size() == 8192 and a.get_vocab_size() == 1024
    assert [big.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert [big.token_to_id(t) for t in THINK_TOKENS] == [8190, 8191]
    prose = "Return a new ordered dictionary whose keys are the elements of an iterable argument."
    assert len(big.encode(prose).ids) < len(a.encode(prose).ids) < len(prose.encode()) // 2
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(100)


def test_sharded_tied_llama3_rope_model_loads(model_factory):
    path = model_factory("llama", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True, max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((path / s).is_file() for s in shards)
    assert not (path / "model.safetensors").exists()
    assert "lm_head.weight" not in index["weight_map"]  # tied
    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_parameters"] == LLAMA3_ROPE and raw["tie_word_embeddings"] is True
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.rope_parameters["rope_type"] == "llama3"
    ids = AutoTokenizer.from_pretrained(str(path))("The quick brown fox jumps over it")["input_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    assert 2.0 < logits.std(dim=-1).mean().item() < 4.5
    assert (logits.argmax(-1) != torch.tensor(ids)).float().mean() > 0.5  # not just copying the input


def test_mixtures_of_experts_count_their_parameters_as_hf_does():
    from coserve.model.presets import MOE_ARCHS
    for arch in MOE_ARCHS:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(build_config("small", arch))
        assert sum(p.numel() for p in model.parameters()) == PRESETS["small"].num_parameters(arch)


def test_small_preset_has_about_30m_parameters():
    for arch in (*ARCHS, "seed_oss", "olmo3"):
        cfg = build_config("small", arch)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        n = sum(p.numel() for p in model.parameters())
        assert n == PRESETS["small"].num_parameters(arch)
        assert 25_000_000 <= n <= 35_000_000, n
        assert cfg.vocab_size == 8192 and cfg.max_position_embeddings == 2048 and not cfg.tie_word_embeddings
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (8, 512, 2)


def test_same_seed_same_weights_other_seed_differs(model_factory, tmp_path):
    base = _weights(model_factory("llama"))
    again = _weights(create_model(str(tmp_path / "again"), arch="llama", seed=0))
    other = _weights(create_model(tmp_path / "other", arch="llama", seed=1))
    assert base.keys() == again.keys() == other.keys()
    assert all(torch.equal(base[k], again[k]) for k in base)
    assert not torch.equal(base["model.layers.0.self_attn.q_proj.weight"],
                           other["model.layers.0.self_attn.q_proj.weight"])
    assert (tmp_path / "again" / "tokenizer.json").read_text() == (model_factory("llama") / "tokenizer.json").read_text()


def test_half_precision_dtype_is_written(tmp_path):
    path = create_model(tmp_path / "bf16", arch="mistral", dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in _weights(path).values())
    assert AutoConfig.from_pretrained(str(path)).dtype in ("bfloat16", torch.bfloat16)


@pytest.mark.parametrize("kwargs, field", [
    ({"preset": "huge"}, "preset"),
    ({"arch": "gpt2"}, "arch"),
    ({"dtype": "int8"}, "dtype"),
    ({"arch": "qwen2", "rope_scaling": LLAMA3_ROPE}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "nonsense"}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"max_shard_size": "lots"}, "max_shard_size"),
    ({"head_dim": 31}, "head_dim"),
    ({"head_dim": 0}, "head_dim"),
    ({"arch": "qwen2", "head_dim": 32}, "head_dim"),
])
def test_bad_arguments_raise_value_error_naming_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        create_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()  # nothing written



class _SlowTokenizer:
    """A tokenizer without a fast backend: ``encode`` must call it."""

    def __init__(self):
        self.calls = []

    def __call__(self, text, add_special_tokens=True):
        self.calls.append((text, add_special_tokens))
        return {"input_ids": (7, 8)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_encode_one_text_is_the_tokenizers_call(model_factory, arch):
    """``encode`` (the backend on the calling thread) gives exactly ``tokenizer(text)["input_ids"]``, with or
    without special tokens, where the text holds special tokens itself, and for a tokenizer without a backend."""
    from coserve.model.tokenizer import encode, load_tokenizer
    tok = load_tokenizer(model_factory(arch))
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True)
    long = "a long text, tokenized through the batch path. " * 400  # over ONE_THREAD_CHARS
    for text in [*TEXTS, chat, "", " leading space", "ünïcödé ✓ 中文", "<|im_start|>user<|im_end|>", long]:
        for special in (True, False):
            assert encode(tok, text, special) == tok(text, add_special_tokens=special)["input_ids"], (text, special)
    slow = _SlowTokenizer()
    assert encode(slow, "x", False) == [7, 8] and slow.calls == [("x", False)]
