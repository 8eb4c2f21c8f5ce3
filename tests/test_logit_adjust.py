"""Presence, frequency and repetition penalties and logit bias (coserve/model/logit_adjust.py): greedy outputs
against HF's model with HF's own logits processors (repetition, bias) and OpenAI's documented formula (presence,
frequency) applied step by step."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from coserve import LLM, SamplingParams
from coserve.model.logit_adjust import LogitAdjustments, adjust_logits
from coserve.model.sampling import SamplingRow, sample

# A random-weight model rarely repeats a token within a few steps, so the settings that only act on repeats
# encourage them (negative penalties, a repetition penalty below 1); "bias" bans and boosts the plain output's tokens.
SETTINGS = [
    dict(frequency_penalty=-2.0),
    dict(presence_penalty=-2.0),
    dict(repetition_penalty=0.3),
    dict(repetition_penalty=0.5, frequency_penalty=1.0),
    "bias",
    dict(frequency_penalty=-1.0, presence_penalty=-1.0, repetition_penalty=0.8, logit_bias={11: 3.0}),
]


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", device="cpu")


def _hf_greedy(hf, prompt: list[int], n: int, s: dict) -> list[int]:
    """HF's logits, then: HF's sequence-bias processor, HF's repetition-penalty processor (over the prompt and
    the output, as vLLM), then OpenAI's formula: logit - frequency * count - presence * (count > 0)."""
    ids = list(prompt)
    processors = []
    if s.get("logit_bias"):
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in s["logit_bias"].items()}))
    if s.get("repetition_penalty", 1.0) != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(s["repetition_penalty"]))
    with torch.inference_mode():
        for _ in range(n):
            input_ids = torch.tensor([ids])
            scores = hf(input_ids).logits[:, -1].float()
            for proc in processors:
                scores = proc(input_ids, scores)
            counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long),
                                    minlength=scores.shape[-1]).float()
            scores = scores[0] - s.get("frequency_penalty", 0.0) * counts - s.get("presence_penalty", 0.0) * (counts > 0)
            ids.append(int(scores.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s if isinstance(s, str) else ",".join(s))
def test_greedy_outputs_with_penalties_and_bias_match_hf(llm, model_factory, hf_model_cache, setting):
    hf = hf_model_cache(model_factory("llama"))
    prompts = [llm.tokenizer(t)["input_ids"] for t in ("the the the the", "Once upon a time", "a b a b a b")]
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    if setting == "bias":
        setting = dict(logit_bias={plain[0].token_ids[2]: -100.0, plain[1].token_ids[0]: -3.5,
                                   plain[2].token_ids[5]: 4.0})
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **setting))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf, prompt, 12, setting)
    assert any(o.token_ids != p.token_ids for o, p in zip(outs, plain))  # the setting changed something


def test_a_bias_of_minus_100_bans_a_token_and_plus_100_forces_it(llm):
    prompt = llm.tokenizer("Hello world")["input_ids"]
    free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    banned = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                   logit_bias={free[0]: -100}))[0].token_ids
    assert free[0] not in banned
    forced = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                                                   logit_bias={42: 100}))[0].token_ids
    assert forced == [42] * 8


def test_reported_logprobs_stay_those_of_the_raw_logits(llm):
    prompt = llm.tokenizer("Log probabilities")["input_ids"]
    raw = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=2))[0].outputs[0].logprobs[0]
    biased = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=2,
                                                   logit_bias={raw.token_id: -100}))[0].outputs[0].logprobs[0]
    assert biased.token_id != raw.token_id
    assert biased.top == raw.top  # the same distribution, reported raw


def test_sample_leaves_the_callers_logits_alone():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    before = logits.clone()
    adjust = LogitAdjustments(output_ids=[2, 2], prompt_ids=[], frequency_penalty=2.0)
    tokens = sample(logits, [SamplingRow(0, -1, 1.0, None, adjust), SamplingRow(0, -1, 1.0, None)])
    assert tokens == [1, 0] and torch.equal(logits, before)
    assert adjust_logits(before[0], adjust).tolist() == [1.0, 2.0, -1.0]


@pytest.mark.parametrize("field,value,message", [
    ("presence_penalty", 2.5, "presence_penalty must be a number in \\[-2, 2\\]"),
    ("frequency_penalty", "1", "frequency_penalty must be a number"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a positive number"),
    ("logit_bias", {"5": 1.0}, "logit_bias: '5' is not a token id"),
    ("logit_bias", {5: 101}, "logit_bias: the bias of token 5 must be a number in \\[-100, 100\\]"),
])
def test_bad_settings_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_a_bias_outside_the_vocabulary_is_refused_before_any_work(llm):
    with pytest.raises(ValueError, match="logit_bias: token id 999999 is outside the vocabulary"):
        llm.generate("x", SamplingParams(logit_bias={999999: 1.0}))


@pytest.mark.parametrize("penalty", [1e-40, 5e-324])
def test_a_repetition_penalty_near_zero_leaves_finite_logits(llm, penalty):
    """It divided a positive logit to +inf (the penalty is 0 in float32): the probabilities went NaN and the drawn
    token id past the vocabulary failed every iteration carrying the request."""
    logits = torch.tensor([3.0, -2.0, 1.0, 0.5])
    out = adjust_logits(logits, LogitAdjustments(output_ids=[0], prompt_ids=[1, 2], repetition_penalty=penalty))
    assert torch.isfinite(out).all() and out.argmax() in (0, 2) and out[3] == 0.5  # the unseen token untouched
    before = llm.engine.num_failed_iterations
    done = llm.generate("hello hello hello", SamplingParams(max_tokens=4, temperature=1.0, seed=2, ignore_eos=True,
                                                            repetition_penalty=penalty))[0]
    assert len(done.token_ids) == 4 and done.error is None and llm.engine.num_failed_iterations == before
