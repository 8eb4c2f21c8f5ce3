"""The HF reference models of the benchmarks and tests: Gemma 2 through eager attention, the one that caps its
scores (transformers 5.17 chose SDPA for it by default, without the cap); the others as transformers chooses."""

from __future__ import annotations

import torch

from coserve import LLM, SamplingParams
from coserve.bench.hf_reference import hf_load_kwargs, load_hf_model


def test_gemma2_loads_with_eager_attention_and_generates_coserves_tokens(model_factory):
    path = model_factory("gemma2")
    assert hf_load_kwargs(path) == {"attn_implementation": "eager"}
    hf = load_hf_model(path).eval()
    assert hf.config._attn_implementation == "eager"
    ids = [0, 451, 884, 1042, 281, 311, 17, 99]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids == want


def test_other_architectures_load_as_transformers_chooses(model_factory):
    assert hf_load_kwargs(model_factory("llama")) == {}
    assert hf_load_kwargs(model_factory("gemma3")) == {}
