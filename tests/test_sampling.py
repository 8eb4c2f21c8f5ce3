"""Sampling: seeds, top-k, top-p, stop strings and tokens, logprobs."""

from __future__ import annotations

import pytest
import torch

from coserve import LLM, SamplingParams
from coserve.model import sampling
from coserve.model.sampling import SamplingRow, draw, filtered_probs, sample


def one_row(logits, row):
    """``filtered_probs`` of one row ``[V]``."""
    return filtered_probs(logits.unsqueeze(0), [row])[0]


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", device="cpu")


def test_same_seed_same_tokens_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    alone = llm.generate("Hello there", params)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = llm.generate(["x y z", "Hello there", "more words"], [others, params, others])
    assert batch[1].token_ids == alone
    different = llm.generate("Hello there", SamplingParams(max_tokens=16, temperature=1.0, seed=124,
                                                           ignore_eos=True))[0].token_ids
    assert different != alone


def test_top_k_and_top_p_filter_exactly():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    probs = one_row(logits, SamplingRow(1.0, 2, 1.0, None))
    assert (probs[2:] == 0).all() and probs[:2].sum().item() == pytest.approx(1.0)
    p = logits.softmax(-1)  # [0.55, 0.20, 0.12, 0.07, 0.03]
    probs = one_row(logits, SamplingRow(1.0, -1, float(p[0] + p[1]) - 1e-3, None))
    assert (probs > 0).tolist() == [True, True, False, False, False]
    probs = one_row(logits, SamplingRow(1.0, -1, 0.01, None))
    assert (probs > 0).tolist() == [True, False, False, False, False]  # the top token always stays


def test_a_batch_filters_each_row_as_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    rows = [SamplingRow(1.0, -1, 1.0, None), SamplingRow(0.7, 5, 1.0, None), SamplingRow(1.3, -1, 0.8, None),
            SamplingRow(1.0, 40, 0.95, None, min_p=0.02), SamplingRow(0.5, 0, 1.0, None, min_p=0.1),
            SamplingRow(2.0, 1000, 0.5, None)]
    together = filtered_probs(logits, rows)
    for i, row in enumerate(rows):  # bit for bit: no filter reaches another row
        assert torch.equal(together[i], one_row(logits[i], row))


def test_top_p_sorts_the_likeliest_tokens_first_and_a_wide_nucleus_whole():
    """Rows whose nucleus lies within the top ``TOP_P_CANDIDATES`` and rows whose nucleus does not (sorted whole),
    in one batch: each keeps what sorting its whole row keeps."""
    vocab = 300  # more than TOP_P_CANDIDATES
    g = torch.Generator().manual_seed(1)
    peaky = -2.0 * torch.log(torch.arange(1.0, vocab + 1))[torch.randperm(vocab, generator=g)]
    flat = 0.01 * torch.randn(vocab, generator=g)  # a nucleus of about 0.9 * 300 tokens
    logits = torch.stack([peaky, flat, peaky.flip(0), flat.flip(0)])
    rows = [SamplingRow(1.0, -1, top_p, None) for top_p in (0.9, 0.9, 0.5, 0.99)]
    kept = filtered_probs(logits, rows) > 0
    for i, row in enumerate(rows):
        sorted_probs, order = logits[i].softmax(-1).sort(descending=True)
        n = int(((sorted_probs.cumsum(-1) - sorted_probs) < row.top_p).sum())  # tokens before the mass is reached
        assert set(order[:n].tolist()) == set(kept[i].nonzero().squeeze(1).tolist())
    assert kept[0].sum() < sampling.TOP_P_CANDIDATES < kept[1].sum()  # both paths ran


def test_draws_follow_the_probabilities_and_never_pick_a_dropped_token():
    probs = torch.tensor([[0.0, 0.5, 0.3, 0.2, 0.0, 0.0]]).repeat(20_000, 1)
    tokens = draw(probs, [None] * len(probs), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6) / len(tokens)
    assert counts[[0, 4, 5]].sum() == 0
    torch.testing.assert_close(counts, probs[0], atol=0.015, rtol=0)
    seeded = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(7)]
    three = draw(torch.tensor([[0.25] * 4, [0.25] * 4, [0.25] * 4]), seeded)
    assert three[0] == three[2]  # the same seed, the same number: a row's draw is its own


def test_low_temperature_sampling_approaches_greedy():
    logits = torch.tensor([[3.0, 2.9, -5.0]])
    gen = torch.Generator().manual_seed(0)
    picks = [sample(logits, [SamplingRow(0.01, -1, 1.0, gen)])[0] for _ in range(50)]
    assert set(picks) == {0}


def test_max_tokens_and_finish_reasons(llm):
    out = llm.generate("Count:", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids_end_the_request(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free = llm.generate("Tokens flow", params)[0].token_ids
    stop_at = free[3]
    out = llm.generate("Tokens flow", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                     stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[:free.index(stop_at) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_stop_strings_cut_the_text(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free = llm.generate("Text goes", params)[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate("Text goes", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                   stop=[stop]))[0]
    assert out.text == text[:text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.token_ids) < 24


def test_logprobs_match_a_log_softmax_of_hf_logits(llm, model_factory, hf_model_cache):
    ids = llm.tokenizer("Log probabilities")["input_ids"]
    out = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 3
    hf = hf_model_cache(model_factory("llama"))
    with torch.inference_mode():
        ref = hf(torch.tensor([ids + out.token_ids])).logits[0].log_softmax(-1)
    for i, lp in enumerate(lps):
        row = ref[len(ids) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert list(lp.top) == row.topk(3).indices.tolist()
        assert max(lp.top.values()) == pytest.approx(lp.logprob, abs=1e-6)  # greedy picked the top one
        assert lp.rank == 1  # vLLM's rank of the likeliest


def test_chat_renders_the_template_once(llm):
    messages = [{"role": "user", "content": "Say hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids.count(llm.tokenizer.bos_token_id) <= 1
    assert len(out.token_ids) == 4


def test_a_stop_string_completed_by_the_last_allowed_token_still_cuts_the_text(llm):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    free = llm.generate("Edge case", params)[0]
    # the shortest text ending the output that appears nowhere before its last token
    tails = [llm.tokenizer.decode(free.token_ids[-n:], skip_special_tokens=True).strip() for n in range(1, 5)]
    stop = next(t for t in tails if t and free.text.find(t) == len(free.text) - len(t))
    out = llm.generate("Edge case", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.token_ids == free.token_ids
    assert out.text == free.text[:-len(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_a_tiny_positive_temperature_is_floored_not_fatal(llm):
    """5e-324 overflowed the logits to inf and the NaN probabilities stopped the engine thread."""
    params = SamplingParams(max_tokens=4, temperature=5e-324, seed=1, ignore_eos=True)
    assert params.temperature == 0.01
    assert len(llm.generate("Hello", params)[0].token_ids) == 4
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("inf"))


def test_a_row_its_masks_leave_no_token_samples_its_raw_logits():
    """Every logit -inf drew a token id past the vocabulary (and greedy took token 0, which no mask allowed)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    nothing = torch.zeros(50, dtype=torch.bool)
    some = torch.zeros(50, dtype=torch.bool)
    some[[7, 9]] = True
    for temperature in (0.0, 1.0):
        rows = [SamplingRow(temperature, -1, 1.0, torch.Generator().manual_seed(1), allowed=nothing),
                SamplingRow(temperature, -1, 1.0, torch.Generator().manual_seed(1), allowed=some),
                SamplingRow(temperature, -1, 1.0, torch.Generator().manual_seed(1))]
        tokens = sample(logits, rows)
        unmasked = sample(logits[[0]], [SamplingRow(temperature, -1, 1.0, torch.Generator().manual_seed(1))])
        assert tokens[0] == unmasked[0] and 0 <= tokens[0] < 50
        assert tokens[1] in (7, 9)
        assert tokens[2] == sample(logits[[2]], [SamplingRow(temperature, -1, 1.0,
                                                             torch.Generator().manual_seed(1))])[0]


def test_contradictory_constraints_end_their_own_request_not_the_iteration(llm):
    """allowed_token_ids beside a guide that allows none of them: at a temperature this failed every iteration that
    carried the request, and its batch-mates with it."""
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = llm.generate("Hello there", plain)[0].token_ids
    stuck = SamplingParams(max_tokens=6, temperature=1.0, seed=3, allowed_token_ids=[1, 2, 3], guided_regex="[ab]+")
    outs = llm.generate(["Hello there", "x y"], [plain, stuck])
    assert outs[0].token_ids == alone and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason in ("stop", "length") and outs[1].error is None
    assert llm.engine.num_failed_iterations == 0


def test_priority_scheduling_changes_the_order_not_the_outputs(llm, model_factory):
    """vLLM's priority policy: a tight engine (one request at a time) serves the most urgent first; greedy outputs
    are those of first-come-first-served; under fcfs a priority is an error, not silently dropped."""
    prompts = ["one two", "three four", "five six"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    fcfs = llm.generate(prompts, params)
    tight = LLM(model_factory("llama"), dtype="float32", device="cpu", scheduling_policy="priority", max_num_seqs=1)
    ids = [tight.engine.add_request(p, params, priority=pr) for p, pr in zip(prompts, (5, 0, 2))]
    finished = []
    while tight.engine.has_unfinished_requests():
        finished += [o.request_id for o in tight.engine.step() if o.finished]
    assert finished == [ids[1], ids[2], ids[0]]
    outs = tight.generate(prompts, params, priority=[5, 0, 2])
    assert [o.token_ids for o in outs] == [o.token_ids for o in fcfs]
    with pytest.raises(ValueError, match="priority: 3 needs the priority scheduling policy"):
        llm.generate("x", params, priority=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_on_cuda_filters_as_on_cpu_and_draws_within_the_filter():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 400, generator=g) * 3
    rows = [SamplingRow(1.0, -1, 1.0, None), SamplingRow(0.7, 20, 1.0, None), SamplingRow(1.0, -1, 0.6, None),
            SamplingRow(1.2, 50, 0.9, None, min_p=0.01), SamplingRow(0.9, -1, 0.95, None)]
    on_cpu, on_cuda = filtered_probs(logits, rows), filtered_probs(logits.cuda(), rows)
    assert torch.equal(on_cpu > 0, on_cuda.cpu() > 0)
    torch.testing.assert_close(on_cuda.cpu(), on_cpu, rtol=1e-5, atol=1e-7)
    seeded = lambda: [torch.Generator(device="cuda").manual_seed(s) for s in range(5)]  # noqa: E731
    first = sample(logits.cuda(), [SamplingRow(r.temperature, r.top_k, r.top_p, gen, min_p=r.min_p)
                                   for r, gen in zip(rows, seeded())])
    again = sample(logits.cuda(), [SamplingRow(r.temperature, r.top_k, r.top_p, gen, min_p=r.min_p)
                                   for r, gen in zip(rows, seeded())])
    assert first == again and all(on_cpu[i, t] > 0 for i, t in enumerate(first))
