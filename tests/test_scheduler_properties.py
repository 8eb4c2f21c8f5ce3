"""Scheduler properties over random workloads, driven with fake results (no model)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.kvcache import BlockManager
from coserve.scheduler import ExecutionResult, Request, SamplingParams, Scheduler, SchedulerConfig

workload = st.lists(st.tuples(st.integers(0, 6),   # arrival step
                              st.integers(1, 30),  # prompt length
                              st.integers(1, 12),  # max_tokens
                              st.sampled_from([None, "a", "b", "c"])),
                    min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(reqs=workload, num_blocks=st.integers(11, 30), block_size=st.integers(1, 6),
       budget=st.integers(1, 40), max_seqs=st.integers(1, 6), max_loras=st.integers(1, 3),
       kv_window=st.one_of(st.none(), st.integers(1, 20)), caching=st.booleans(), spare=st.integers(-1, 8))
def test_every_request_finishes_within_budgets_and_frees_its_blocks(reqs, num_blocks, block_size, budget,
                                                                    max_seqs, max_loras, kv_window, caching, spare):
    """... under a sliding window too (``kv_window``: a request gives up the blocks behind it, never one its next
    chunk reads; or, with ``spare`` >= 0, sliding layers beside whole-context ones, their K/V in a pool of their own
    just large enough for one request's chunk and window plus ``spare``), with the prefix cache on or off."""
    hybrid = kv_window is not None and spare >= 0
    storages = -(-budget // block_size) + -(-kv_window // block_size) + 2 + spare if hybrid else 0
    s = Scheduler(SchedulerConfig(budget, max_seqs, 64, max_loras),
                  BlockManager(num_blocks, block_size, enable_caching=caching, window_storages=storages,
                               window=kv_window))
    pending = []
    for i, (arrive, n_prompt, max_tokens, adapter) in enumerate(reqs):
        # what the engine's validation guarantees: the whole sequence fits the cache, or where every layer slides,
        # what it holds at once (prompts longer than the cache, then)
        while n_prompt > 0 and s.blocks.most_held(n_prompt + max_tokens) > num_blocks:
            n_prompt -= 1
        if n_prompt < 1:
            continue
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        pending.append((arrive, Request(f"r{i}", [1] * n_prompt, params, adapter, frozenset(), 0.0)))
    step = 0
    while step < 2000 and (pending or s.has_unfinished()):
        for arrive, request in [p for p in pending if p[0] <= step]:
            s.add_request(request)
        pending = [p for p in pending if p[0] > step]
        plan = s.schedule()
        # the plan respects every budget and every chunk's blocks cover its tokens
        assert plan.num_scheduled_tokens == sum(len(c.token_ids) for c in plan.chunks) <= budget
        assert len({c.request_id for c in plan.chunks}) == len(plan.chunks)
        assert len(s.running) <= max_seqs
        assert len({r.adapter for r in s.running if r.adapter}) <= max_loras
        for c in plan.chunks:
            assert len(c.block_table) * block_size >= c.end
            assert c.start == s.requests[c.request_id].num_computed_tokens
            first_read = 0 if kv_window is None else max(0, c.start - kv_window + 1)  # the chunk's first key
            assert s.blocks.num_released(c.request_id) <= first_read // block_size
            if hybrid:  # every place the chunk reads in the sliding layers has its storage
                table = s.blocks.block_table(c.request_id)
                assert all(s.blocks.windows.has(b) for b in table[first_read // block_size:-(-c.end // block_size)])
            elif kv_window is not None and not caching:  # (a cached prefix is held until its first chunk has run)
                assert s.blocks.num_held(c.request_id) == s.blocks.held_for(c.start, c.end)  # the rest is released
        s.blocks.check_invariants()
        s.update(plan, ExecutionResult(sampled={c.request_id: 5 for c in plan.chunks if c.sample}))
        step += 1
    assert not s.has_unfinished(), "a request starved"
    for request in s.requests.values():
        assert request.finish_reason in ("length", "stop")
        assert len(request.output_token_ids) == min(request.params.max_tokens,
                                                    64 - request.num_prompt_tokens)
    assert s.blocks.num_free_blocks == num_blocks
