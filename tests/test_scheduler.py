"""The scheduler on plain data: plans fed back with hand-built results, no model."""

from coserve.kvcache import BlockManager
from coserve.scheduler import (ExecutionResult, Request, SamplingParams, Scheduler, SchedulerConfig)


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=256, max_loras=2):
    return Scheduler(SchedulerConfig(budget, max_seqs, max_len, max_loras), BlockManager(num_blocks, block_size))


def req(rid, n_prompt, max_tokens=4, adapter=None, **kw):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw),
                   adapter, frozenset({0}), 0.0)


def run_step(s, token=7):
    plan = s.schedule()
    result = ExecutionResult(sampled={c.request_id: token for c in plan.chunks if c.sample})
    return plan, s.update(plan, result)


def test_chunked_prefill_respects_the_token_budget():
    s = make(budget=10)
    s.add_request(req("a", 23))
    sizes = []
    for _ in range(3):
        plan, events = run_step(s)
        sizes.append([len(c.token_ids) for c in plan.chunks])
    assert sizes == [[10], [10], [3]]
    assert events and events[0].new_token_id == 7  # the last chunk samples


def test_decodes_go_first_and_prefill_fills_the_rest():
    s = make(budget=8)
    s.add_request(req("a", 3, max_tokens=10))
    run_step(s)  # a prefilled, one token sampled
    s.add_request(req("b", 20))
    plan, _ = run_step(s)
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == [("a", 1), ("b", 7)]
    assert plan.num_scheduled_tokens == 8


def test_first_tokens_come_first_among_an_iterations_events():
    s = make(budget=32)
    s.add_request(req("a", 3, max_tokens=10))
    s.add_request(req("b", 3, max_tokens=10))
    run_step(s)  # a and b prefilled
    s.add_request(req("c", 5))
    plan, events = run_step(s)
    assert [c.request_id for c in plan.chunks] == ["a", "b", "c"]  # decodes go first in the forward
    assert [e.request_id for e in events] == ["c", "a", "b"]  # its first token is delivered before their next ones


def test_admission_only_when_the_whole_prompt_fits():
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add_request(req("big", 17))  # needs 5 blocks of 4
    s.add_request(req("small", 3))
    plan, _ = run_step(s)
    assert plan.chunks == []  # FCFS: the head does not fit, nothing jumps the queue
    assert s.blocks.num_free_blocks == 4


def test_preemption_takes_the_most_recently_admitted_and_recomputes_it():
    s = make(num_blocks=4, block_size=4, budget=64, max_len=64)
    s.add_request(req("old", 4, max_tokens=12))  # at most 16 tokens: the whole cache
    s.add_request(req("new", 8, max_tokens=8))
    run_step(s)  # both prefilled: old holds 1 block, new 2; one free
    for _ in range(8):
        plan, _ = run_step(s)
        if plan.preempted:
            break
    assert plan.preempted == ["new"]
    assert s.num_preemptions == 1
    new = s.requests["new"]
    assert new.num_computed_tokens == 0 and not s.blocks.has("new")
    assert s.waiting[0] is new
    # once "old" finishes, "new" is admitted again and recomputes its prompt plus outputs
    while not s.requests["old"].is_finished:
        run_step(s)
    outputs_before = len(new.output_token_ids)
    plan, _ = run_step(s)
    chunk = next(c for c in plan.chunks if c.request_id == "new")
    assert chunk.start == 0 and len(chunk.token_ids) == 8 + outputs_before
    s.blocks.check_invariants()


def test_finish_on_eos_max_tokens_and_stop_token():
    s = make()
    s.add_request(req("eos", 2, max_tokens=10))
    s.add_request(req("stop_id", 2, max_tokens=10, stop_token_ids=[5]))
    s.add_request(req("ignore", 2, max_tokens=3, ignore_eos=True))
    plan = s.schedule()
    events = s.update(plan, ExecutionResult(sampled={"eos": 0, "stop_id": 5, "ignore": 0}))
    done = {e.request_id: e.finish_reason for e in events if e.finished}
    assert done == {"eos": "stop", "stop_id": "stop"}
    run_step(s, token=0)
    _, events = run_step(s, token=0)
    assert [(e.request_id, e.finish_reason) for e in events] == [("ignore", "length")]
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_max_loras_bounds_distinct_adapters_running():
    s = make(max_loras=2, budget=64)
    for i, a in enumerate(["x", "y", None, "z", "x"]):
        s.add_request(req(f"r{i}", 3, adapter=a))
    plan = s.schedule()
    assert [c.request_id for c in plan.chunks] == ["r0", "r1", "r2"]  # r3 ("z") waits, FCFS
    assert plan.adapters == ["x", "y"]


def test_abort_frees_blocks_and_is_reported_in_the_next_plan():
    s = make()
    s.add_request(req("a", 5, max_tokens=50))
    run_step(s)
    s.finish_request("a", "abort")
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    plan = s.schedule()
    assert plan.finished == ["a"] and plan.chunks == []
    assert s.requests["a"].finish_reason == "abort"


def test_max_num_seqs_caps_running_requests():
    s = make(max_seqs=2, budget=64)
    for i in range(4):
        s.add_request(req(f"r{i}", 2))
    plan = s.schedule()
    assert len(plan.chunks) == 2 and len(s.waiting) == 2


def test_a_request_that_outgrows_the_whole_cache_ends_with_length():
    s = make(num_blocks=2, block_size=4, budget=64, max_len=64)
    s.add_request(req("a", 4, max_tokens=30))  # the engine refuses this; the scheduler must not spin
    for _ in range(10):
        run_step(s)
    assert s.requests["a"].finish_reason == "length"
    assert len(s.requests["a"].output_token_ids) == 5  # 8 tokens fill both blocks
    assert not s.has_unfinished()


def test_priority_policy_admits_the_most_urgent_waiting_request_first():
    for policy, first in (("fcfs", "early-lax"), ("priority", "late-urgent")):
        s = make(max_seqs=1)
        s.config.scheduling_policy = policy
        s.add_request(req("early-lax", 3))
        s.requests["early-lax"].priority = 5
        s.add_request(req("late-urgent", 3))
        plan, _ = run_step(s)
        assert [c.request_id for c in plan.chunks] == [first]


def test_priority_policy_preempts_the_least_urgent_request_not_the_newest():
    s = make(num_blocks=4, block_size=4, budget=64, max_len=64)
    s.config.scheduling_policy = "priority"
    s.add_request(req("old-lax", 4, max_tokens=12))
    s.requests["old-lax"].priority = 3
    s.add_request(req("new-urgent", 8, max_tokens=8))
    run_step(s)
    for _ in range(8):
        plan, _ = run_step(s)
        if plan.preempted:
            break
    assert plan.preempted == ["old-lax"]  # fcfs would take "new-urgent", the tail (test above)
    assert [c.request_id for c in plan.chunks] == ["new-urgent"]
    s.blocks.check_invariants()


def test_priority_policy_gives_the_token_budget_to_the_most_urgent_running_request():
    for policy, third in (("fcfs", [("lax", 1), ("urgent", 5)]), ("priority", [("urgent", 6)])):
        s = make(budget=6)
        s.config.scheduling_policy = policy
        s.add_request(req("lax", 10))
        s.requests["lax"].priority = 2
        run_step(s)  # lax alone: 6 of its 10 prompt tokens
        s.add_request(req("urgent", 10))
        plan, _ = run_step(s)  # running requests first, then the new one
        assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == [("lax", 4), ("urgent", 2)]
        plan, _ = run_step(s)  # lax decodes, urgent still prefills: who gets the budget first
        assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == third


def _delayed(factor: float):
    clock = [0.0]
    s = Scheduler(SchedulerConfig(64, 8, 256, 2, scheduler_delay_factor=factor), BlockManager(64, 4),
                  clock=lambda: clock[0])
    return s, clock


def _admitted(plan, running_before: set[str]) -> list[str]:
    return [c.request_id for c in plan.chunks if c.request_id not in running_before]


def test_the_scheduler_delay_lets_prompts_gather_while_requests_run():
    """vLLM's scheduler_delay_factor: with a request running, a new prompt waits until the oldest waiting one
    has waited factor x the last prompt iteration's latency; the prompts that came meanwhile share its pass."""
    s, clock = _delayed(2.0)
    s.add_request(req("a", 4, max_tokens=50))
    plan, _ = run_step(s)  # nothing running: admitted at once
    assert [c.request_id for c in plan.chunks] == ["a"]
    clock[0] = 0.25  # that prompt iteration took 250 ms (planned to planned)
    run_step(s)
    assert s.last_prompt_latency_s == 0.25
    s.add_request(req("b", 4, max_tokens=50))  # queued at 0.25
    clock[0] = 0.5
    s.add_request(req("c", 4, max_tokens=50))
    for t in (0.5, 0.6, 0.74):  # b waited less than 2 x 250 ms: decode alone
        clock[0] = t
        plan, _ = run_step(s)
        assert [c.request_id for c in plan.chunks] == ["a"]
    clock[0] = 0.75  # b has waited 500 ms: b and c in one iteration
    plan, _ = run_step(s)
    assert sorted(_admitted(plan, {"a"})) == ["b", "c"]


def test_without_a_delay_factor_or_with_nothing_running_prompts_go_at_once():
    s, clock = _delayed(0.0)
    s.add_request(req("a", 4, max_tokens=50))
    run_step(s)
    s.add_request(req("b", 4))
    plan, _ = run_step(s)
    assert "b" in [c.request_id for c in plan.chunks]
    s, clock = _delayed(5.0)
    s.last_prompt_latency_s = 1.0
    s.add_request(req("x", 4))  # nothing running: no reason to wait
    plan, _ = run_step(s)
    assert [c.request_id for c in plan.chunks] == ["x"]


def test_a_preempted_request_resumes_without_the_delay():
    s, clock = _delayed(10.0)
    s.last_prompt_latency_s = 1.0
    s.add_request(req("a", 4, max_tokens=50))
    run_step(s)
    s.add_request(req("b", 4, max_tokens=50))
    s.waiting.remove(s.requests["b"])  # b as a preempted request: back at the head, not newly queued
    s._queued_at.pop("b")
    s.waiting.appendleft(s.requests["b"])
    plan, _ = run_step(s)
    assert "b" in [c.request_id for c in plan.chunks]


def test_the_delay_factor_is_checked():
    import pytest
    for bad in (-1, float("inf"), True, "2"):
        with pytest.raises(ValueError, match="scheduler_delay_factor"):
            SchedulerConfig(scheduler_delay_factor=bad)


def test_a_request_growing_past_longropes_original_context_is_computed_again_by_the_long_factors():
    """LongRoPE (Phi-3, original context 12 here): a request whose sequence grows past the original context runs
    its next iteration as a prompt of all its tokens, every one rotated by the long factors (``long_rope``), its
    blocks keyed apart from the short ones in the prefix cache; one longer from the start is long from its first
    chunk."""
    s = Scheduler(SchedulerConfig(64, 8, 64, 2, long_rope_from=12), BlockManager(64, 4, enable_caching=True))
    s.add_request(req("short", 10, max_tokens=8))
    s.add_request(req("long", 13, max_tokens=2))
    plan, _ = run_step(s)
    assert [(c.request_id, c.start, len(c.token_ids), c.long_rope) for c in plan.chunks] == [
        ("short", 0, 10, False), ("long", 0, 13, True)]
    short = s.requests["short"]
    keys = list(short.block_keys)
    for _ in range(2):  # positions 10 and 11: the sequence holds 13 tokens, 12 computed
        plan, _ = run_step(s)
        assert [c.long_rope for c in plan.chunks if c.request_id == "short"] == [False]
    plan, _ = run_step(s)
    chunk = next(c for c in plan.chunks if c.request_id == "short")
    assert (chunk.start, len(chunk.token_ids), chunk.long_rope, chunk.sample) == (0, 13, True, True)
    assert s.num_long_rope_recomputes == 1 and s.num_preemptions == 0
    assert len(keys) == 2 and short.block_keys[:2] != keys  # its blocks again, under other keys
    run_step(s)
    assert short.num_computed_tokens == 14 and len(short.output_token_ids) == 5
    s.blocks.check_invariants()


def test_drafts_stop_at_longropes_original_context():
    """A short sequence's n-gram drafts end at LongRoPE's original context: their logits rotate by the short
    factors, as the tokens before them."""
    def drafts(long_rope_from):
        s = Scheduler(SchedulerConfig(64, 8, 64, 2, speculative_tokens=4, long_rope_from=long_rope_from),
                      BlockManager(64, 4))
        s.add_request(Request("r", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=8, temperature=0),
                              None, frozenset({0}), 0.0))
        run_step(s, token=3)  # the sequence ends 1, 2, 3: drafts 4, 1, 2, 3 follow
        plan, _ = run_step(s)
        return plan.chunks[0].num_drafts
    assert drafts(None) == 4 and drafts(12) == 1  # 11 tokens known: position 11 is the last within 12


def test_where_every_layer_slides_prompts_longer_than_the_cache_run_in_chunks_cut_to_the_free_blocks():
    """Window 8 over a cache of 8 blocks of 4 (32 positions): a request is admitted when its window's span fits (3
    blocks decoding), and its prompt's chunks are cut to the free blocks (the blocks behind its window come back as
    it goes) rather than preempting for them."""
    s = Scheduler(SchedulerConfig(24, 8, 256, 2), BlockManager(8, 4, window=8))
    s.add_request(req("a", 40, max_tokens=3))  # 40 prompt tokens: more than the cache holds
    s.add_request(req("b", 30, max_tokens=3))
    chunks = []
    while s.has_unfinished():
        plan, _ = run_step(s)
        chunks += [(c.request_id, c.start, len(c.token_ids)) for c in plan.chunks]
        s.blocks.check_invariants()
    assert chunks[:2] == [("a", 0, 24), ("a", 24, 16)]  # b waits: a's chunk leaves 2 free blocks, b's span is 3
    assert ("b", 0, 20) in chunks  # 23 of the budget left, 30 to go: cut to the 5 free blocks
    assert s.num_preemptions == 0 and s.blocks.num_free_blocks == 8
    assert [len(s.requests[r].output_token_ids) for r in "ab"] == [3, 3]
