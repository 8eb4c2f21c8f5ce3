"""Prompt logprobs (SamplingParams.prompt_logprobs; the completions API's echo with logprobs) against HF's
log-softmax over the prompt, with the prompt split across chunked-prefill iterations and after preemption."""

from __future__ import annotations

import pytest
import torch

from coserve import LLM, SamplingParams
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine


def _check_against_hf(hf, prompt: list[int], prompt_logprobs, n: int) -> None:
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    for i, lp in enumerate(prompt_logprobs[1:], start=1):
        row = ref[i - 1]
        assert lp.token_id == prompt[i]
        assert lp.logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        chosen = row[prompt[i]]  # vLLM's rank: the tokens at least as likely (within HF's rounding of them)
        assert int((row > chosen + 1e-4).sum()) + 1 <= lp.rank <= int((row >= chosen - 1e-4).sum())
        assert list(lp.top) == row.topk(n).indices.tolist()
        assert list(lp.top.values()) == pytest.approx(row.topk(n).values.tolist(), abs=1e-4)


def test_prompt_logprobs_match_hf_across_prefill_chunks(model_factory, hf_model_cache):
    model_dir = model_factory("llama")
    hf = hf_model_cache(model_dir)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64,
                                    block_size=4, max_num_batched_tokens=16))  # 40 and 23 tokens: 2-3 chunks each
    prompts = [[(7 * i + 3) % 200 + 5 for i in range(40)], [(11 * i + 1) % 190 + 5 for i in range(23)], [9]]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while len(done) < len(ids):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, prompt in zip(ids, prompts):
        _check_against_hf(hf, prompt, done[rid].prompt_logprobs, 3)
    plain = engine.add_request(prompts[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while True:
        outs = [o for o in engine.step() if o.finished]
        if outs:
            assert outs[0].request_id == plain and outs[0].prompt_logprobs is None
            assert outs[0].token_ids == done[ids[1]].token_ids  # scoring the prompt changed nothing
            break


def test_a_preempted_request_keeps_its_prompt_logprobs_once(model_factory, hf_model_cache):
    model_dir = model_factory("llama")
    hf = hf_model_cache(model_dir)
    # a cache of 12 blocks of 4: two requests of 20 + up to 20 tokens cannot both finish without a preemption
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=12,
                                    block_size=4, max_num_batched_tokens=64))
    prompts = [[(5 * i + 2) % 150 + 5 for i in range(20)], [(3 * i + 4) % 170 + 5 for i in range(20)]]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=1)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while len(done) < len(ids):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sum(done[r].num_preemptions for r in ids) >= 1
    for rid, prompt in zip(ids, prompts):
        _check_against_hf(hf, prompt, done[rid].prompt_logprobs, 1)


def test_prompt_logprobs_through_the_python_api_and_bad_values(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    out = llm.generate("one two three", SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[0] is None and all(lp.top == {} for lp in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match="prompt_logprobs must be None or a non-negative integer"):
        SamplingParams(prompt_logprobs=-1)
