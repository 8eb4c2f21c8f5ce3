"""Beam search (vLLM's ``LLM.beam_search``) against HF transformers' ``generate(num_beams=...)`` as the oracle."""

from __future__ import annotations

import pytest
import torch

from coserve import LLM, BeamSearchParams


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_beams_are_hf_beam_search_s(model_factory, hf_model_cache, arch):
    model_dir = model_factory(arch)
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=4)  # small blocks: the prompts fill some
    hf = hf_model_cache(model_dir)
    prompts = [[5, 6, 7, 8], [100, 30, 2000, 17, 44, 9]]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                              max_new_tokens=8, min_new_tokens=8, early_stopping=False, pad_token_id=0)
        assert [b.tokens[len(prompt):] for b in out.sequences] == [r[len(prompt):].tolist() for r in ref]
        scores = [b.cum_logprob for b in out.sequences]
        assert scores == sorted(scores, reverse=True)
        assert out.sequences[0].text == llm.tokenizer.decode(out.sequences[0].tokens[len(prompt):],
                                                             skip_special_tokens=True)
    # the beams share their prompt's blocks: each round computes little more than one token per beam
    assert llm.engine.scheduler.prefix_cache_hits > 0


def test_bad_beam_search_params_name_the_field():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=-1)
