"""Automatic prefix caching: shared full KV blocks keyed by content, tenant and adapter; the block pool's accounting
under any operations (hypothesis); the scheduler starting a request after its cached blocks; and the engine's
outputs with the cache as without it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve import LLM, SamplingParams
from coserve.kvcache import BlockManager, block_key
from coserve.scheduler import Request, Scheduler, SchedulerConfig
from coserve.scheduler.plan import ExecutionResult, TokenLogprobs

BS = 4


def keys_of(tokens: list[int], salt: str = "") -> list[int]:
    keys: list[int] = []
    for i in range(len(tokens) // BS):
        keys.append(block_key(keys[-1] if keys else None, tuple(tokens[i * BS:(i + 1) * BS]), salt))
    return keys


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 16), ops=st.lists(st.tuples(st.sampled_from(["start", "grow", "free", "release"]),
                                                              st.integers(0, 4), st.integers(0, 3),
                                                              st.integers(1, 20)), max_size=50),
       window=st.one_of(st.none(), st.integers(1, 12)))
def test_shared_blocks_are_counted_and_evicted_without_loss(num_blocks, ops, window):
    """Sequences drawn from four prompt families share cached blocks; after every operation each block is held,
    free or evictable exactly once, reference counts match the tables, and a cached block's key matches what
    its holder's tokens make of it; a sliding window's releases of a sequence's first blocks included, and with
    every layer sliding (``window``) a prefix matched by its last window alone, the places before it given up."""
    bm = BlockManager(num_blocks, BS, enable_caching=True, window=window)
    families = [[random.Random(f).randrange(50) for _ in range(80)] for f in range(4)]
    live: dict[str, tuple[int, int, int]] = {}  # seq -> (family, tokens held, blocks registered)
    for op, seq, family, n in ops:
        sid = f"s{seq}"
        if op == "start" and sid not in live:
            tokens = families[family][:n]
            prefix = bm.match(keys_of(tokens)[:(n - 1) // BS])
            if window is not None and prefix:  # the window before the prefix's end is cached, the rest may not be
                first = max(0, (len(prefix) * BS - window + 1) // BS)
                assert prefix[:first] == [None] * first and None not in prefix[first:]
            if bm.can_allocate(sid, n, prefix):
                bm.allocate(sid, n, prefix)
                live[sid] = (family, n, len(prefix))
        elif op == "grow" and sid in live:
            f, held, registered = live[sid]
            want = min(held + n, 80)
            if bm.can_allocate(sid, want):
                bm.allocate(sid, want)
                held = want
            full = keys_of(families[f][:held])
            for i in range(registered, len(full)):
                bm.register(sid, i, full[i])
            live[sid] = (f, held, len(full))
        elif op == "release" and sid in live:  # blocks behind a sliding window, registered ones among them
            bm.release_front(sid, n // BS)
        elif op == "free" and sid in live:
            bm.free(sid)
            del live[sid]
        bm.check_invariants()
        for s, (f, held, registered) in live.items():
            table, keys = bm.block_table(s), keys_of(families[f][:held])
            assert len(table) == bm.blocks_for(held)
            for i in range(bm.num_released(s), registered):  # a registered block it holds, if cached, is cached
                key = bm._key_of.get(table[i])  # under its key
                assert key is None or key == keys[i]


def test_a_cached_block_is_reused_then_evicted_oldest_first():
    bm = BlockManager(4, BS, enable_caching=True)
    tokens = list(range(8))
    bm.allocate("a", 8)
    for i, key in enumerate(keys_of(tokens)):
        bm.register("a", i, key)
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    prefix = bm.match(keys_of(tokens + [9]))
    assert prefix == bm.block_table("a") or len(prefix) == 2
    bm.allocate("b", 9, prefix)
    assert bm.block_table("b")[:2] == prefix and bm.num_free_blocks == 1
    bm.free("b")
    bm.allocate("c", 12)  # needs 3 blocks: the free ones first, then the cached tail block, then the head
    assert bm.num_cached_blocks == 1 and bm.match(keys_of(tokens)) == [prefix[0]]
    bm.check_invariants()


def _scheduler(num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256),
                     BlockManager(num_blocks, BS, enable_caching=True))


def _request(rid: str, tokens: list[int], salt: str = "t\x00None\x00", **params) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=2, temperature=0, **params), None, frozenset(), 0.0,
                   cache_salt=salt)


def _run_to_end(s: Scheduler) -> list:
    plans = []
    while s.has_unfinished():
        plan = s.schedule()
        plans.append(plan)
        scored = {c.request_id: [TokenLogprobs(t, 0.0) for t in c.prompt_targets] for c in plan.chunks
                  if c.prompt_targets is not None}
        s.update(plan, ExecutionResult(sampled={c.request_id: 7 for c in plan.chunks if c.sample},
                                       prompt_logprobs=scored))
    return plans


def test_a_request_starts_after_the_blocks_an_earlier_one_computed():
    s = _scheduler()
    shared = list(range(100, 110))  # two full blocks and two tokens
    s.add_request(_request("a", shared + [1, 2, 3]))
    _run_to_end(s)
    s.add_request(_request("b", shared + [4, 5]))
    (first, *_) = _run_to_end(s)
    (chunk,) = first.chunks
    assert chunk.start == 8 and chunk.token_ids == shared[8:] + [4, 5]
    assert s.prefix_cache_hits == 8 and s.prefix_cache_queries == 13 + 12
    s.add_request(_request("c", shared[:8]))  # wholly cached: its last block is computed (its last token's logits)
    (first, *_) = _run_to_end(s)
    assert first.chunks[0].start == 4


@pytest.mark.parametrize("other", [
    {"salt": "other-tenant\x00None\x00"},  # another tenant (or adapter, or adapter install)
    {"prompt_logprobs": 1},  # scores its prompt: every position is computed
])
def test_no_hit_across_salts_or_for_prompt_scoring(other):
    s = _scheduler()
    s.add_request(_request("a", list(range(100, 113))))
    _run_to_end(s)
    salt = other.pop("salt", "t\x00None\x00")
    s.add_request(_request("b", list(range(100, 113)), salt, **other))
    (first, *_) = _run_to_end(s)
    assert first.chunks[0].start == 0


def test_with_the_pool_full_of_cached_blocks_new_requests_still_fit():
    s = _scheduler(num_blocks=8)
    for i in range(6):
        s.add_request(_request(f"r{i}", [i * 50 + t for t in range(20)]))  # 6 blocks each with outputs
        _run_to_end(s)
        s.blocks.check_invariants()
    assert s.blocks.num_free_blocks == 8 and s.blocks.num_cached_blocks > 0


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("llama")


def test_outputs_with_the_cache_are_those_without(model_dir):
    """Prompts sharing prefixes of every length, in waves (so later ones hit), with a KV cache small enough to evict
    and preempt: the same greedy tokens with the cache as without, logprobs within 1e-5."""
    rng = random.Random(3)
    stem = [rng.randrange(5, 300) for _ in range(40)]
    prompts = [stem[:rng.randint(1, 40)] + [rng.randrange(5, 300) for _ in range(rng.randint(1, 6))]
               for _ in range(24)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)

    def run(caching: bool):
        llm = LLM(model_dir, dtype="float32", device="cpu", block_size=4, num_kv_blocks=40,
                  max_num_batched_tokens=64, enable_prefix_caching=caching)
        outs = [o for wave in range(0, 24, 6) for o in llm.generate(prompts[wave:wave + 6], params)]
        return outs, llm.engine.scheduler

    cold, _ = run(False)
    warm, scheduler = run(True)
    assert scheduler.prefix_cache_hits > 0 and scheduler.num_preemptions + scheduler.blocks.num_cached_blocks > 0
    for a, b in zip(cold, warm):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) <= 1e-5


def test_an_adapter_installed_again_under_its_name_does_not_reuse_the_old_ones_blocks(model_dir, tmp_path):
    import torch

    from coserve.peft.config import LoraConfig
    from coserve.peft.trainable import TrainableLora

    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=4)
    model = llm.engine.model
    for seed, name in ((1, "one"), (2, "two")):
        lora = TrainableLora(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                             model.module_shapes(), model.cfg.num_layers, model.device,
                             torch.Generator().manual_seed(seed))
        for p in lora.parameters():
            torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(seed))
        lora.save_pretrained(tmp_path / name)
    prompt = list(range(20, 40))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    llm.load_adapter("a", tmp_path / "one")
    llm.generate([prompt], params, adapter="a")
    llm.generate([prompt], params)  # the base model: other K/V
    assert llm.engine.scheduler.prefix_cache_hits == 0
    llm.generate([prompt], params, adapter="a")
    hits = llm.engine.scheduler.prefix_cache_hits
    assert hits == 16  # the same adapter again: its first four blocks
    llm.load_adapter("a", tmp_path / "two")  # the same name, other weights
    replaced = llm.generate([prompt], params, adapter="a")[0]
    assert llm.engine.scheduler.prefix_cache_hits == hits
    fresh = LLM(model_dir, dtype="float32", device="cpu", block_size=4)
    fresh.load_adapter("a", tmp_path / "two")
    assert replaced.outputs[0].token_ids == fresh.generate([prompt], params, adapter="a")[0].outputs[0].token_ids


def test_a_sliding_window_models_released_blocks_stay_cached_for_the_next_request(config_variant, hf_model_cache):
    """Mistral sliding over 12 positions: a request gives up its blocks behind the window while it runs, and the ones
    the cache registered stay cached (evictable). Once another request has taken the oldest of them, the same prompt
    again still starts after its first nine blocks: only the last window before that point is read, so only those
    blocks need to be cached (the places before are given up from the start). Greedy tokens as HF's both times."""
    path = config_variant("mistral", sliding_window=12)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=16, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    blocks, released = llm.engine.scheduler.blocks, []
    release_front = blocks.release_front
    blocks.release_front = lambda seq, count: released.append(release_front(seq, count)) or released[-1]
    prompt = list(range(20, 60))  # 10 blocks
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert sum(released) == 13  # all but its last 3 of 16 blocks while it ran
    llm.generate([list(range(100, 120))], SamplingParams(max_tokens=4, temperature=0))  # takes the 6 oldest
    second = llm.generate([prompt], params)[0]
    scheduler = llm.engine.scheduler
    assert second.num_cached_tokens == 36  # all but the last block: blocks 6-8 hold what position 36 reads
    assert scheduler.prefix_cache_hits == 36
    import torch
    hf = hf_model_cache(path)
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert first.token_ids == second.token_ids == want
