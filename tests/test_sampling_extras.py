"""vLLM's sampling extras: min_p (against HF's MinPLogitsWarper), min_tokens, allowed_token_ids, stop_token_ids and
include_stop_str_in_output, in Python and through the server."""

from __future__ import annotations

import pytest
import torch
from transformers import MinPLogitsWarper

from coserve import LLM, SamplingParams
from coserve.model.sampling import SamplingRow, filtered_probs


def one_row(logits, row):
    """``filtered_probs`` of one row ``[V]``."""
    return filtered_probs(logits.unsqueeze(0), [row])[0]


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", device="cpu")


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5), (1.0, 1.0)])
def test_min_p_keeps_what_hf_keeps(min_p, temperature):
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(1)) * 3
    for row in logits:
        ours = one_row(row, SamplingRow(temperature, -1, 1.0, None, min_p=min_p))
        hf = MinPLogitsWarper(min_p)(None, (row / temperature).unsqueeze(0))[0].softmax(-1)
        assert torch.equal(ours > 0, hf > 0)
        torch.testing.assert_close(ours, hf, rtol=1e-6, atol=1e-7)


def _eos(llm) -> int:
    return llm.engine.tokenizer.eos_token_id


def test_min_tokens_holds_back_end_of_sequence_and_stop_tokens(llm):
    eos = _eos(llm)
    eager = SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100.0})
    assert llm.generate(["Hello"], eager)[0].outputs[0].token_ids == [eos]
    held = SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100.0}, min_tokens=5)
    out = llm.generate(["Hello"], held)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    stop_token = llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0))[0].outputs[0].token_ids[0]
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, min_tokens=3, ignore_eos=True,
                                                 logit_bias={stop_token: 100.0}, stop_token_ids=[stop_token]))[0]
    assert out.outputs[0].token_ids[:3].count(stop_token) == 0 and out.outputs[0].token_ids[3] == stop_token
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_token


def test_allowed_token_ids_are_the_only_ones_sampled(llm):
    allowed = [11, 12, 13, 500, 501]
    out = llm.generate(["Hello"], SamplingParams(max_tokens=30, temperature=1.0, seed=2, ignore_eos=True,
                                                 allowed_token_ids=allowed))[0].outputs[0]
    assert set(out.token_ids) <= set(allowed) and len(set(out.token_ids)) > 1
    with pytest.raises(ValueError, match="allowed_token_ids: token id 99999"):
        llm.generate(["Hello"], SamplingParams(allowed_token_ids=[99999]))


def test_stop_strings_keep_or_cut_and_wait_for_min_tokens(llm):
    free = llm.generate(["Once upon"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
    early = llm.engine.tokenizer.decode(free.token_ids[:2])[-3:]  # text the first two tokens end with
    params = dict(max_tokens=16, temperature=0, ignore_eos=True, stop=[early])
    cut = llm.generate(["Once upon"], SamplingParams(**params))[0].outputs[0]
    kept = llm.generate(["Once upon"], SamplingParams(**params, include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == cut.text + early and free.text.startswith(kept.text)
    waited = llm.generate(["Once upon"], SamplingParams(**params, min_tokens=4))[0].outputs[0]
    assert len(waited.token_ids) >= 4 and len(waited.text) > len(cut.text)  # the early occurrence did not stop it


@pytest.mark.parametrize("bad, message", [(dict(min_p=1.5), "min_p"),
                                          (dict(min_tokens=30, max_tokens=10), "min_tokens"),
                                          (dict(allowed_token_ids=[]), "allowed_token_ids"),
                                          (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
                                          (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
                                          (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens")])
def test_bad_extras_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's ``truncate_prompt_tokens``: the request is the one its prompt's last k tokens make, for token-id and
    text prompts; -1 keeps as much as the context holds (a longer prompt still leaves no room to generate, as in
    vLLM); more than the context is refused, naming the field."""
    greedy = dict(max_tokens=5, temperature=0, ignore_eos=True)
    ids = list(range(10, 40))
    cut = llm.generate([ids], SamplingParams(truncate_prompt_tokens=7, **greedy))[0]
    assert cut.prompt_token_ids == ids[-7:]
    assert cut.token_ids == llm.generate([ids[-7:]], SamplingParams(**greedy))[0].token_ids
    text = "one two three four five six seven eight nine ten"
    whole = llm.tokenizer(text)["input_ids"]
    assert llm.generate(text, SamplingParams(truncate_prompt_tokens=3, **greedy))[0].prompt_token_ids == whole[-3:]
    assert llm.generate([ids], SamplingParams(truncate_prompt_tokens=100, **greedy))[0].prompt_token_ids == ids
    limit = llm.engine.max_model_len
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([ids], SamplingParams(truncate_prompt_tokens=limit + 1, **greedy))
    with pytest.raises(ValueError, match="no room to generate"):
        llm.generate([[11] * (limit + 5)], SamplingParams(truncate_prompt_tokens=-1, **greedy))


def test_skip_special_tokens_false_writes_them_into_the_text(llm):
    """vLLM's ``skip_special_tokens``: by default special tokens are left out of the text; with False the text is
    ``decode(ids, skip_special_tokens=False)`` (a stop string may then match one)."""
    special = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = dict(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={special: 100.0})
    out = llm.generate("Hi", SamplingParams(**forced))[0]
    assert out.token_ids == [special] * 6 and out.text == ""
    kept = llm.generate("Hi", SamplingParams(skip_special_tokens=False, **forced))[0]
    assert kept.text == llm.tokenizer.decode(kept.token_ids, skip_special_tokens=False) == "<|im_start|>" * 6
    cut = llm.generate("Hi", SamplingParams(skip_special_tokens=False, stop=["|><|im"], **forced))[0]
    assert cut.text == "<|im_start" and cut.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")


def test_the_token_that_stopped_the_output_is_not_in_its_text(llm):
    """As in vLLM, the stop token (EOS, or one of ``stop_token_ids``, special or not) ends the output's token ids
    but not its text, unless ``include_stop_str_in_output``: with ``skip_special_tokens`` False, EOS's text does not
    end every reply."""
    eos, word = llm.tokenizer.eos_token_id, llm.tokenizer.encode("the", add_special_tokens=False)[0]
    forced = dict(max_tokens=4, temperature=0, skip_special_tokens=False)
    out = llm.generate("Hi", SamplingParams(logit_bias={eos: 100.0}, **forced))[0].outputs[0]
    assert out.token_ids == [eos] and out.text == "" and out.finish_reason == "stop"
    kept = llm.generate("Hi", SamplingParams(logit_bias={eos: 100.0}, include_stop_str_in_output=True, **forced))[0]
    assert kept.outputs[0].text == llm.tokenizer.eos_token
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, stop_token_ids=[word],
                            logit_bias={word: 100.0})
    out = llm.generate("Hi", params)[0].outputs[0]
    assert out.token_ids == [word] and out.text == "" and out.stop_reason == word
    free = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].outputs[0]
    stopped = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                stop_token_ids=[free.token_ids[2]]))[0].outputs[0]
    assert stopped.token_ids == free.token_ids[:3]
    assert stopped.text == llm.tokenizer.decode(free.token_ids[:2], skip_special_tokens=True)


def test_reasoning_tags_that_are_special_tokens_stay_in_the_text(llm):
    """A reasoning parser whose tags are special tokens (Magistral's ``[THINK]``) must find them in the text: a
    request whose ``reasoning`` says so decodes special tokens, whatever ``skip_special_tokens`` says."""
    from coserve.scheduler.sampling_params import ReasoningTokens

    start, end = (llm.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    forced = dict(max_tokens=2, temperature=0, ignore_eos=True, logit_bias={start: 100.0})
    hidden = llm.generate("Hi", SamplingParams(reasoning=ReasoningTokens(start, end, False), **forced))[0]
    shown = llm.generate("Hi", SamplingParams(reasoning=ReasoningTokens(start, end, False, special=True), **forced))[0]
    assert hidden.token_ids == shown.token_ids == [start, start]
    assert hidden.text == "" and shown.text == "<|im_start|><|im_start|>"


def test_bad_word_bans_are_hfs_no_bad_words_processor_over_the_output():
    """The tokens ``bad_word_bans`` bans are those HF's ``NoBadWordsLogitsProcessor`` sets to -inf, given the output
    so far (random word sequences of 1-3 tokens that often end the output)."""
    from transformers import NoBadWordsLogitsProcessor

    from coserve.model.logit_adjust import bad_word_bans
    rng = torch.Generator().manual_seed(3)
    vocab, eos = 12, 11
    for _ in range(200):
        output = torch.randint(0, eos, (int(torch.randint(1, 6, (1,), generator=rng)),), generator=rng).tolist()
        words = [torch.randint(0, eos, (int(torch.randint(1, 4, (1,), generator=rng)),), generator=rng).tolist()
                 for _ in range(3)]
        words.append(output[-1:] + [5])  # one that the output's last token begins
        hf = NoBadWordsLogitsProcessor(words, eos_token_id=eos)(torch.tensor([output]), torch.zeros(1, vocab))[0]
        assert set(bad_word_bans(words, output)) == set(torch.nonzero(hf == float("-inf")).flatten().tolist())


def test_bad_words_are_never_written_and_the_output_before_them_stands(llm):
    """vLLM's ``bad_words``: a word the free greedy output writes (one token, then two) is never written; up to
    where it was, the output is the free one's. Blank words are refused, naming the field."""
    from coserve.model.logit_adjust import bad_word_ids
    tok = llm.tokenizer
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    free = llm.generate("Once upon a time", SamplingParams(**greedy))[0].token_ids

    def word_of(span: list[int]) -> str | None:
        """The span's text, where the tokenizer splits that text back into exactly the span (bare or spaced)."""
        text = tok.decode(span)
        return text if text.strip() and span in bad_word_ids(tok, [text]) else None

    for width in (1, 2):
        at, word = next((i, w) for i in range(len(free) - width + 1)
                        for w in [word_of(free[i:i + width])] if w is not None)
        banned = free[at:at + width]
        out = llm.generate("Once upon a time", SamplingParams(bad_words=[word], **greedy))[0].token_ids
        assert out[:at + width - 1] == free[:at + width - 1] and out[at + width - 1] != banned[-1]
        spans = {tuple(s) for s in bad_word_ids(tok, [word])}
        assert not any(tuple(out[i:i + len(s)]) in spans for s in spans for i in range(len(out)))
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])
    with pytest.raises(ValueError, match="bad_words_token_ids: token id 1000000000 is outside the vocabulary"):
        llm.generate("x", SamplingParams(bad_words_token_ids=[[10**9]]))


def test_bad_words_are_tokenized_once_for_n_sequences_and_repeated_requests(llm, monkeypatch):
    import coserve.engine.llm_engine as llm_engine
    calls = []
    real = llm_engine.bad_word_ids
    monkeypatch.setattr(llm_engine, "bad_word_ids", lambda tok, words: calls.append(list(words)) or real(tok, words))
    params = SamplingParams(max_tokens=4, n=3, seed=1, bad_words=["upon", "zebra crossing"])
    first = llm.generate(["Once upon a time", "A tale"], params)
    again = llm.generate(["Once upon a time"], params)
    assert calls == [["upon", "zebra crossing"]]  # six sequences, then three more: one tokenization
    assert [o.token_ids for o in again[0].outputs] == [o.token_ids for o in first[0].outputs]
