"""vLLM's ``SamplingParams(n=...)`` in the Python API: ``n`` sequences per prompt in one RequestOutput, each the
request its seed (``seed + i``) makes on its own, and ``n`` refused where a single engine request is made."""

from __future__ import annotations

import pytest

from coserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", device="cpu")


def test_n_sequences_per_prompt_are_each_the_request_of_its_own_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate(["Hello there", [5, 9, 17, 3]], params)
    assert len(outs) == 2
    for out, prompt in zip(outs, ["Hello there", [5, 9, 17, 3]]):
        assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished and out.error is None
        for i, seq in enumerate(out.outputs):
            alone = llm.generate(prompt, SamplingParams(temperature=1.0, seed=5 + i, max_tokens=8, ignore_eos=True,
                                                        logprobs=1))[0].outputs[0]
            assert (seq.token_ids, seq.text, seq.logprobs) == (alone.token_ids, alone.text, alone.logprobs)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the seeds drew differently
    assert outs[0].text == outs[0].outputs[0].text  # a RequestOutput's text is its first sequence's, as before


def test_n_mixes_with_single_sequences_and_greedy_n_repeats_the_greedy_answer(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    single, twice = llm.generate(["Once upon", "Once upon"], [greedy, SamplingParams(n=2, temperature=0, max_tokens=6,
                                                                                     ignore_eos=True)])
    assert len(single.outputs) == 1 and len(twice.outputs) == 2
    assert twice.outputs[0].token_ids == twice.outputs[1].token_ids == single.token_ids
    chatted = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(n=2, max_tokens=4, seed=1))
    assert len(chatted) == 1 and len(chatted[0].outputs) == 2


@pytest.mark.parametrize("n", [0, -1, True, 2.0, "2"])
def test_a_bad_n_is_refused_naming_it(n):
    with pytest.raises(ValueError, match="^n must be a positive integer"):
        SamplingParams(n=n)


def test_the_engine_takes_one_sequence_a_request(llm):
    with pytest.raises(ValueError, match="^n: 2 sequences need 2 requests"):
        llm.engine.add_request([5, 6, 7], SamplingParams(n=2))
    seeded = SamplingParams(n=2, seed=2**63 - 1, max_tokens=2)  # the second sequence's seed wraps as the server's
    assert len(llm.generate([5, 6, 7], seeded)[0].outputs) == 2
