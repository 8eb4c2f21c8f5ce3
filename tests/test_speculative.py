"""Speculative decoding by n-gram lookup: the drafts proposed, and greedy outputs token-identical to decoding
without it (drafts accepted along the way), through stop tokens, max_tokens, preemption and ineligible requests."""

from __future__ import annotations

import random

import pytest

from coserve import LLM, SamplingParams
from coserve.scheduler.ngram_drafts import propose_drafts


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_tail():
    assert propose_drafts([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # "1 2 3" seen before, followed by 9 1 2
    assert propose_drafts([5, 1, 7, 6, 1, 8, 4, 1], 2) == [8, 4]  # only "1" repeats: its latest occurrence
    assert propose_drafts([1, 2, 3, 4], 3) == []  # nothing repeats
    assert propose_drafts([1, 2, 1, 2], 0) == []
    assert propose_drafts([4, 4, 4, 4], 5) == [4]  # the tail "4 4 4" occurred at 0, followed by one 4


REPEATING = [[(i % 7) + 10 for i in range(30)], [20, 21, 22, 23] * 6, list(range(40, 60)) + list(range(40, 50))]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_outputs_are_those_without_speculation(model_factory, arch):
    model_dir = model_factory(arch)
    rng = random.Random(2)
    prompts = REPEATING + [[rng.randrange(5, 300) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),  # speculated
              SamplingParams(max_tokens=17, temperature=0, ignore_eos=True),  # ends mid-run: exactly 17
              SamplingParams(max_tokens=40, temperature=0),  # may stop at EOS
              SamplingParams(max_tokens=30, temperature=0.8, seed=4, ignore_eos=True),  # sampled: not speculated
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1),  # logprobs: not speculated
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=["zz"])]  # stop strings: neither

    def run(k: int, **kw):
        llm = LLM(model_dir, dtype="float32", device="cpu", speculative_tokens=k, **kw)
        return llm.generate(prompts, params), llm.engine.scheduler

    plain, _ = run(0)
    spec, scheduler = run(4)
    assert scheduler.num_accepted_drafts > 0 and scheduler.num_draft_tokens > scheduler.num_accepted_drafts
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert len(spec[1].outputs[0].token_ids) == 17
    # a stop token met inside an accepted run ends the request where decoding without drafts ends it
    stop_at = plain[0].outputs[0].token_ids[25]
    stopping = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    cut_plain = LLM(model_dir, dtype="float32", device="cpu").generate([prompts[0]], stopping)[0].outputs[0]
    cut_spec = LLM(model_dir, dtype="float32", device="cpu", speculative_tokens=4).generate(
        [prompts[0]], stopping)[0].outputs[0]
    assert cut_spec.token_ids == cut_plain.token_ids and cut_spec.token_ids[-1] == stop_at
    # and with a KV cache small enough to preempt
    tight, scheduler = run(4, num_kv_blocks=24, block_size=4)
    assert scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in plain]
