"""HF transformers is the oracle: logits and greedy generation on tiny models of every architecture."""

from __future__ import annotations

import math

import pytest
import torch

from coserve import LLM, SamplingParams
from coserve.model.attention import PagedKVCache
from coserve.model.forward_batch import SequenceChunk, build_forward_batch
from coserve.model.loader import load_model
from model_variants import phi3_longrope, yarn_variant

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n\nprint(add(",
    "A",
    "Scheduling decides which tokens run in every iteration, and how many of them",
    "JSON: {\"key\": [1, 2, 3]",
]


_HF_GREEDY: dict[tuple[str, str, tuple[int, ...], int], list[int]] = {}  # HF's greedy tokens, by model directory,
#   dtype, prompt and length: the engine settings each test a model against the same reference


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    key = (str(hf.config._name_or_path), str(hf.dtype), tuple(ids), n)
    if key not in _HF_GREEDY:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        _HF_GREEDY[key] = out[0, len(ids):].tolist()
    return list(_HF_GREEDY[key])


def _flat_logits(path, prompts_ids, splits=None):
    """All-position logits from one flat forward (optionally two chunks per sequence)."""
    model = load_model(path, torch.float32, torch.device("cpu"))
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.device("cpu"),
                         torch.float32)
    tables, next_block = [], 0
    for ids in prompts_ids:
        nb = -(-len(ids) // 4)
        tables.append(list(range(next_block, next_block + nb))[::-1])  # scattered, reversed blocks
        next_block += nb
    chunks, tokens, row = [], [], 0
    long = model.long_rope_from  # LongRoPE: a prompt past the original context rotates by the long factors
    for ids, table in zip(prompts_ids, tables):
        chunks.append(SequenceChunk(row, row + len(ids), len(ids), table, long is not None and len(ids) > long))
        tokens.append(ids)
        row += len(ids)
    batch = build_forward_batch(tokens, chunks, 4, list(range(row)), torch.device("cpu"), long_rope_from=long)
    logits = model.logits(model.forward(batch, cache))
    return [logits[c.start:c.end] for c in chunks]


def _as_hf(path, llm, hf, ids: list[list[int]], n: int, logits: bool = True):
    """Logits of one flat forward over ``ids`` (where ``logits``) and ``n`` greedy tokens of each through ``llm``, as
    HF's forward and generate give them; the outputs."""
    if logits:
        for seq, got in zip(ids, _flat_logits(path, ids)):
            with torch.inference_mode():
                torch.testing.assert_close(got, hf(torch.tensor([seq])).logits[0], atol=1e-4, rtol=0)
    outs = llm.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for seq, out in zip(ids, outs):
        assert out.token_ids == _hf_greedy(hf, seq, n)
    return outs


def test_prefill_logits_match_hf(tiny_model, hf_model_cache):
    llm = LLM(tiny_model, dtype="float32", device="cpu")
    ids = [llm.tokenizer(p)["input_ids"] for p in PROMPTS]
    hf = hf_model_cache(tiny_model)
    ours = _flat_logits(tiny_model, ids)
    for seq, got in zip(ids, ours):
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0].float()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


ENGINE_SETTINGS = {
    "default": {},
    "chunked-odd": {"max_num_batched_tokens": 7},
    "chunked-3-small-blocks": {"max_num_batched_tokens": 3, "block_size": 5},
    "preempting": {"num_kv_blocks": 20, "block_size": 4, "max_num_batched_tokens": 13},
}


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
def test_greedy_generation_matches_hf_generate(tiny_model, hf_model_cache, setting):
    llm = LLM(tiny_model, dtype="float32", device="cpu", **ENGINE_SETTINGS[setting])
    hf = hf_model_cache(tiny_model)
    # min_tokens: the end-of-sequence tokens (<|end_of_text|>, <|im_end|>) masked to the last, as HF's min_new_tokens
    # masks them (ignore_eos would let the model pick one: the tiny Mixtral's 32nd token here)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, min_tokens=32, temperature=0))
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == llm.tokenizer(prompt)["input_ids"]
        assert out.token_ids == _hf_greedy(hf, out.prompt_token_ids, 32), prompt
    if setting == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0


def test_llama3_rope_scaling_tied_embeddings_and_shards(model_factory, hf_model_cache):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    path = model_factory("llama", rope_scaling=rope, tie_word_embeddings=True, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.engine.model_config.rope.rope_type == "llama3"
    assert llm.engine.model_config.tie_word_embeddings
    hf = hf_model_cache(path)
    ids = [llm.tokenizer(p)["input_ids"] for p in PROMPTS]
    for seq, got in zip(ids, _flat_logits(path, ids)):
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0].float()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == _hf_greedy(hf, out.prompt_token_ids, 32)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_yarn_rope_scaling_serves_as_hf_does(model_factory, config_variant, hf_model_cache, arch):
    """YaRN (Qwen2.5 and Qwen3's long-context setting: factor 4 over an original context of 32 here), its
    frequencies and attention factor: logits and greedy tokens with prompts in chunks of 7 as HF's, past the original
    context."""
    path = yarn_variant(model_factory, config_variant, arch)
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=7)
    rope = llm.engine.model_config.rope
    assert rope.rope_type == "yarn" and rope.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    _as_hf(path, llm, hf_model_cache(path), [(llm.tokenizer(p)["input_ids"] * 20)[:40] for p in PROMPTS], 24)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
# Gemma: norm weights (1 + w) in float32, then the cast; GLM-4.5: its router in float32; gpt-oss: sinks, float32 norms
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3", "glm4_moe", "gpt_oss"])
def test_half_precision_runs_close_to_hf(model_factory, hf_model_cache, dtype, arch):
    path = model_factory(arch)
    llm = LLM(path, dtype=dtype, device="cpu")
    assert llm.engine.model.embed.dtype == getattr(torch, dtype)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    ids = llm.tokenizer(PROMPTS[3])["input_ids"]
    model = load_model(path, getattr(torch, dtype), torch.device("cpu"))
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, 16, 16, cfg.num_kv_heads, cfg.head_dim, torch.device("cpu"),
                         model.dtype)
    batch = build_forward_batch([ids], [SequenceChunk(0, len(ids), len(ids), [0, 1, 2])], 16,
                                list(range(len(ids))), torch.device("cpu"))
    got = model.logits(model.forward(batch, cache))
    with torch.inference_mode():
        ref = hf_model_cache(path, torch.float32)(torch.tensor([ids])).logits[0]
    assert torch.isfinite(got).all()
    # half precision: close to the float32 oracle, not equal
    assert (got - ref).abs().max() / ref.abs().max() < 0.05


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_heads_wider_than_hidden_over_heads_match_hf(model_factory, hf_model_cache, arch):
    """Qwen3's (and Llama-3.2's) shape: ``head_dim`` set apart from ``hidden_size / num_attention_heads``, so that
    q/o are wider than the hidden state (here 4 heads of 32 over a hidden state of 64)."""
    path = model_factory(arch, head_dim=32)
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.engine.model.cfg.q_size == 128 != llm.engine.model.cfg.hidden_size
    ids = [llm.tokenizer(p)["input_ids"] for p in PROMPTS]
    hf = hf_model_cache(path)
    for seq, got in zip(ids, _flat_logits(path, ids)):
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0].float()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for out in outs:
        assert out.token_ids == _hf_greedy(hf, out.prompt_token_ids, 16)


@pytest.mark.parametrize("arch,fields", [
    ("mistral", {"sliding_window": 24}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1, "layer_types": None}),
    ("phi3", {"sliding_window": 24}),
])
@pytest.mark.parametrize("setting", ["default", "chunked-odd", "preempting", "cuda"])
def test_a_sliding_window_model_attends_past_its_window_as_hf_does(model_factory, config_variant, hf_model_cache,
                                                                   arch, fields, setting):
    """A model whose layers attend to a sliding window (Mistral-7B-v0.1's 4,096 tokens, Qwen2/3 with
    ``use_sliding_window`` on some layers, Phi-3-mini-4k's 2,047) serves its whole context, each sliding layer over the
    last ``sliding_window`` positions: logits and greedy tokens as HF's sliding-window model has them, well past the
    window, through whole prompts, prefill chunks after a prefix and decode steps. HF's differ there from
    whole-context attention (the window is needed)."""
    if setting == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device (there the variable-length kernel masks the window, decode graphs too)")
    path = config_variant(arch, **fields)
    llm = LLM(path, dtype="float32", device="cuda" if setting == "cuda" else "cpu",
              **ENGINE_SETTINGS.get(setting, {}))
    assert llm.engine.max_model_len == 512 and llm.engine.model_config.sliding_window == 24
    hf = hf_model_cache(path)
    ids = [(llm.tokenizer(p)["input_ids"] * 6)[:n] for p, n in zip(PROMPTS, (12, 30, 5, 38, 25))]
    _as_hf(path, llm, hf, ids, 40, logits=setting == "default")
    long = list(range(5, 45))
    full = hf_model_cache(model_factory(arch))  # the same weights, every layer over its whole context
    with torch.inference_mode():
        assert torch.equal(hf(torch.tensor([long[:24]])).logits, full(torch.tensor([long[:24]])).logits)
        assert not torch.allclose(hf(torch.tensor([long])).logits[0, -1], full(torch.tensor([long])).logits[0, -1])


@pytest.mark.parametrize("arch,fields,window", [
    ("mistral", {"sliding_window": 24}, 24),
    ("phi3", {"sliding_window": 24}, 24),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1, "layer_types": None}, None),
])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_model_whose_every_layer_slides_frees_the_blocks_behind_its_window(config_variant, hf_model_cache, arch,
                                                                            fields, window, device):
    """Where every layer slides (Mistral-7B-v0.1, Phi-3-mini-4k), a running request gives up its KV blocks once they
    are wholly behind the window, and other requests take them: five requests that together held more than 60 blocks
    run in 40 without a preemption, greedy tokens as HF's well past the window (with n-gram drafts too) and logprobs
    bit for bit those of a cache that holds everything; prompts longer than the whole cache are served, each holding
    a window's span decoding, its prompt's chunks cut to the free blocks. A model with a layer over its whole context (Qwen3 sliding above its first
    layer only) keeps every block: there the same requests preempt."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device (there released places are read by the variable-length kernel and decode graphs)")
    path = config_variant(arch, **fields)
    hf = hf_model_cache(path)
    ids = [(list(range(7 + i, 300, 3 + i)) * 3)[:n] for i, n in enumerate((12, 30, 5, 38, 25))]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)

    def run(num_blocks: int, release: bool = True, **settings):
        llm = LLM(path, dtype="float32", device=device, block_size=4, num_kv_blocks=num_blocks,
                  max_num_batched_tokens=13, **settings)
        sampling = params if "speculative_tokens" not in settings else SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True)  # (drafts are for requests that ask no logprobs)
        scheduler, peak = llm.engine.scheduler, [0]
        assert scheduler.blocks.window == window
        if not release:
            scheduler.blocks.window = None
        update = scheduler.update

        def watched(plan, result):
            events = update(plan, result)
            scheduler.blocks.check_invariants()
            peak[0] = max(peak[0], scheduler.blocks.num_blocks - scheduler.blocks.num_free_blocks)
            return events

        scheduler.update = watched
        return llm.generate(ids, sampling), scheduler, peak[0]

    _, _, kept_peak = run(100, release=False)
    assert kept_peak > 60  # every block of every request held to its end
    if window is not None:
        assert run(40, release=False)[1].num_preemptions > 0  # without releasing, the small cache preempts
    roomy, _, _ = run(100)
    tight, scheduler, peak = run(40)
    if window is None:
        assert scheduler.num_preemptions > 0
        return
    assert scheduler.num_preemptions == 0 and peak <= 40
    drafted, speculating, _ = run(40, speculative_tokens=3)  # rejected drafts: positions written, then given back
    assert speculating.num_draft_tokens > speculating.num_accepted_drafts > 0
    for seq, a, b, c in zip(ids, roomy, tight, drafted):
        assert b.token_ids == c.token_ids == _hf_greedy(hf, seq, 40)
        assert a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
    # prompts longer than the whole cache: each holds a window's span of blocks decoding (7), not its 35, its
    # prompt's chunks cut to the free blocks
    longer = [(list(range(11 + i, 300, 7)) * 3)[:100] for i in range(2)]
    small = LLM(path, dtype="float32", device=device, block_size=4, num_kv_blocks=9, max_num_batched_tokens=13)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for seq, out in zip(longer, small.generate(longer, greedy)):
        assert out.token_ids == _hf_greedy(hf, seq, 40)
    smaller = LLM(path, dtype="float32", device=device, block_size=4, num_kv_blocks=6, max_num_batched_tokens=13)
    with pytest.raises(ValueError, match="need 7 KV blocks of 4 tokens at once; the whole cache holds 6"):
        smaller.generate(longer, greedy)


@pytest.mark.parametrize("arch,fields", [
    ("gemma3", {}),  # a sliding layer, then a whole-context one
    ("gemma2", {}),  # the same, its scores soft-capped (laid out per chunk)
    ("qwen3", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1, "layer_types": None}),
    ("olmo3", {}),  # a sliding layer (plain RoPE), then a whole-context one (YaRN)
])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sliding_layers_beside_whole_context_ones_keep_their_k_v_in_a_pool_of_their_own(
        model_factory, config_variant, hf_model_cache, arch, fields, device):
    """Where sliding layers sit beside whole-context ones (Gemma 2 and 3, OLMo 3; Qwen with ``max_window_layers``), the
    sliding layers' K/V live in a smaller pool, one storage per block some request reads within its window (sized
    for ``max_num_seqs`` windows): greedy tokens as HF's well past the window, with preemption, n-gram drafts, and
    the prefix cache serving a second turn; logprobs bit for bit those of the same engine whose sliding layers keep
    K/V in the main blocks (``disable_hybrid_kv_cache_manager``, as where a pool would need as many)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device (there the window layers' map is read by the variable-length kernel's gather and "
                    "recorded in decode graphs)")
    path = config_variant(arch, **fields) if fields else model_factory(arch)
    hf = hf_model_cache(path)
    ids = [(list(range(7 + i, 300, 3 + i)) * 3)[:n] for i, n in enumerate((12, 30, 5, 38, 25))]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, logprobs=1)

    def run(max_num_seqs: int, num_blocks: int = 100, prompts=ids, **settings):
        llm = LLM(path, dtype="float32", device=device, block_size=4, num_kv_blocks=num_blocks,
                  max_num_batched_tokens=13, max_num_seqs=max_num_seqs, **settings)
        scheduler, held = llm.engine.scheduler, [0]
        update = scheduler.update

        def watched(plan, result):
            events = update(plan, result)
            scheduler.blocks.check_invariants()
            if scheduler.blocks.windows is not None:
                held[0] = max(held[0], scheduler.blocks.windows.num_held)
            return events

        scheduler.update = watched
        sampling = params if "speculative_tokens" not in settings else SamplingParams(
            max_tokens=50, temperature=0, ignore_eos=True)  # (drafts are for requests that ask no logprobs)
        return llm, llm.generate(prompts, sampling), held[0]

    window = 32 if arch.startswith("gemma") or arch == "olmo3" else 24
    plain, kept, _ = run(5, disable_hybrid_kv_cache_manager=True)
    assert plain.engine.window_storages == 0 and plain.engine.model_config.pooled_window == window
    assert run(20)[0].engine.window_storages == 0  # 20 requests' windows would need more than the 100 main blocks
    pooled, outs, held = run(5)
    storages = pooled.engine.window_storages
    assert storages == 5 * (-(-(window - 1) // 4) + 2) + 4 < 100 and 0 < held <= storages
    assert pooled.engine.cache.k[pooled.engine.model_config.sliding_layers[0]].shape[0] == storages + 1
    for seq, a, b in zip(ids, kept, outs):
        assert b.token_ids == _hf_greedy(hf, seq, 50)
        assert a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
    tight, tight_outs, _ = run(3, num_blocks=40)  # preempting
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.window_storages < 40
    drafting, drafted, _ = run(5, speculative_tokens=3)
    assert drafting.engine.scheduler.num_accepted_drafts > 0
    for a, b, c in zip(outs, tight_outs, drafted):
        assert a.token_ids == b.token_ids == c.token_ids
    caching, first, _ = run(5, enable_prefix_caching=True)
    turns = [seq + out.token_ids + [9, 10, 11, 12, 13] for seq, out in zip(ids, first)]
    second = caching.generate(turns, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert caching.engine.scheduler.prefix_cache_hits > 200  # the first turns' blocks, their windows kept
    for seq, out in zip(turns, second):
        assert out.token_ids == _hf_greedy(hf, seq, 12)


def test_phi3_longrope_serves_as_hf_does_past_the_original_context(config_variant, hf_model_cache):
    """With long factors (Phi-3-mini-128k, Phi-3.5-mini) the context is the model's whole one, rotated as
    transformers rotates it: a prompt past the original context by the long factors from its first token; a shorter
    one by the short factors until it grows past it, and then computed again by the long ones (as transformers'
    Phi-3 generate computes its cache again). Logits, and greedy tokens with prompts in chunks of 7, as HF's forward
    and generate; with prefix caching, a long prompt does not reuse the blocks of a sequence that stayed short, and
    reuses those of one that grew long."""
    path = phi3_longrope(config_variant)
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=7, enable_prefix_caching=True)
    assert llm.engine.max_model_len == 512 and llm.engine.model.long_rope_from == 32
    assert llm.engine.model_config.rotary_dim == 8 and llm.engine.model_config.rope.attention_factor > 1
    hf = hf_model_cache(path)
    base = [llm.tokenizer(p)["input_ids"] for p in PROMPTS]
    short, long = [ids[:12] for ids in base], [(ids * 40)[:40] for ids in base]
    outs = _as_hf(path, llm, hf, short + long, 40)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert llm.engine.scheduler.num_long_rope_recomputes == len(short)  # each short prompt's sequence, once
    drafting = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=7, speculative_tokens=3)
    assert [o.token_ids for o in drafting.generate(short, greedy)] == [o.token_ids for o in outs[:len(short)]]
    assert drafting.engine.scheduler.num_draft_tokens > 0
    fresh = [7, 8, 9] + short[3][:9]  # no sequence so far starts so
    kept = fresh + llm.generate([fresh], SamplingParams(max_tokens=8, temperature=0))[0].token_ids  # 20 tokens
    hits = llm.engine.scheduler.prefix_cache_hits
    extended = kept + [5] * 20  # 40 tokens, the first 16 in a block the short sequence cached
    assert llm.generate([extended], greedy)[0].token_ids == _hf_greedy(hf, extended, 40)
    assert llm.engine.scheduler.prefix_cache_hits == hits
    crossed = short[0] + outs[0].token_ids + [5, 6, 7]  # its first 48 tokens cached since it grew long
    assert llm.generate([crossed], greedy)[0].token_ids == _hf_greedy(hf, crossed, 40)
    assert llm.engine.scheduler.prefix_cache_hits >= hits + 48
    with pytest.raises(ValueError, match="max_model_len: 600 is more than the model's max_position_embeddings of 512"):
        LLM(path, dtype="float32", device="cpu", max_model_len=600)
