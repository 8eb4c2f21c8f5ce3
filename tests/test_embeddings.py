"""Embeddings (``LLM.embed``, ``PoolingParams``): a prompt's last final hidden state, against HF transformers and HF
PEFT, the same bit for bit whatever runs beside it (generation, a finetuning job, prefix caching)."""

from __future__ import annotations

import pytest
import torch

from coserve import LLM, FinetuneConfig, LoraConfig, SamplingParams
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.scheduler import PoolingParams
from peft_helpers import make_lora_adapter, peft_model
from test_llm_finetune import _data

PROMPTS = [[(7 * i + 3) % 200 + 5 for i in range(40)], [(11 * i + 1) % 190 + 5 for i in range(23)], [9]]


def _hf_hidden(decoder, ids: list[int]) -> torch.Tensor:
    """HF's final hidden state (after the last norm) at the prompt's last token."""
    with torch.inference_mode():
        return decoder(torch.tensor([ids])).last_hidden_state[0, -1].float()


def test_embeddings_match_hf_across_prefill_chunks(tiny_model, hf_model_cache):
    hf = hf_model_cache(tiny_model)
    llm = LLM(tiny_model, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16)  # 40 and 23 tokens: their last rows come from a third and a second chunk
    outs = llm.embed(PROMPTS)
    assert [o.prompt_token_ids for o in outs] == PROMPTS and all(o.finished for o in outs)
    for o, ids in zip(outs, PROMPTS):
        ref = torch.nn.functional.normalize(_hf_hidden(hf.model, ids), dim=0)
        got = torch.tensor(o.outputs.embedding)
        assert got.shape == ref.shape and got.norm().item() == pytest.approx(1.0, abs=1e-6)
        assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    raw = llm.embed(PROMPTS[1], PoolingParams(normalize=False))[0].outputs.embedding
    assert torch.allclose(torch.tensor(raw), _hf_hidden(hf.model, PROMPTS[1]), atol=1e-4, rtol=1e-5)
    cut = llm.embed(PROMPTS[1], PoolingParams(dimensions=8))[0].outputs.embedding  # OpenAI's shortened embedding
    assert torch.allclose(torch.tensor(cut), torch.nn.functional.normalize(torch.tensor(raw[:8]), dim=0), atol=1e-6)
    last = llm.embed(PROMPTS[0], PoolingParams(truncate_prompt_tokens=5))[0]
    assert last.prompt_token_ids == PROMPTS[0][-5:]
    assert torch.allclose(torch.tensor(last.outputs.embedding),
                          torch.nn.functional.normalize(_hf_hidden(hf.model, PROMPTS[0][-5:]), dim=0), atol=1e-5)
    text = "The quick brown fox"
    by_text = llm.embed(text)[0]
    assert by_text.prompt_token_ids == llm.tokenizer(text)["input_ids"]


def test_an_adapters_embedding_matches_hf_peft(model_factory, tmp_path):
    model_dir = model_factory("llama")
    adapter = make_lora_adapter(model_dir, tmp_path / "lora", r=4, lora_alpha=8,
                                target_modules=["q_proj", "v_proj", "down_proj"])
    oracle = peft_model(model_dir, adapter)
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    llm.load_adapter("tuned", adapter)
    outs = llm.embed(PROMPTS[:2], adapter=["tuned", None])
    tuned = torch.nn.functional.normalize(_hf_hidden(oracle.base_model.model.model, PROMPTS[0]), dim=0)
    assert torch.allclose(torch.tensor(outs[0].outputs.embedding), tuned, atol=1e-5)
    with oracle.disable_adapter():
        base = torch.nn.functional.normalize(_hf_hidden(oracle.base_model.model.model, PROMPTS[1]), dim=0)
    assert torch.allclose(torch.tensor(outs[1].outputs.embedding), base, atol=1e-5)
    assert not torch.allclose(torch.tensor(llm.embed(PROMPTS[0])[0].outputs.embedding), tuned, atol=1e-3)


def test_embeddings_are_the_same_beside_generation_and_a_finetuning_job(model_factory, tmp_path):
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=128, block_size=4,
              max_num_batched_tokens=32)
    alone = [o.outputs.embedding for o in llm.embed(PROMPTS)]
    engine = llm.engine  # embedding and generation requests in the same iterations
    gen = [engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
           for _ in range(2)]
    engine.step()  # the generation requests are decoding when the embedding requests arrive
    emb = [engine.add_request(ids, PoolingParams()) for ids in PROMPTS]
    done = {}
    while len(done) < len(gen) + len(emb):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[r].embedding for r in emb] == alone  # bit for bit
    assert all(done[r].embedding is None and len(done[r].token_ids) == 12 for r in gen)
    assert all(done[r].token_ids == [] and done[r].outputs[0].finish_reason == "stop" for r in emb)
    job = llm.finetune(_data(tmp_path / "d.jsonl", n=8), LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"]),
                       FinetuneConfig(output_dir=str(tmp_path / "out"), max_steps=4, batch_size=2, lr=5e-2))
    during = [o.outputs.embedding for o in llm.embed(PROMPTS)]  # the engine runs the job in its thread meanwhile
    assert job.wait(timeout=120)["status"] == "succeeded"
    assert during == alone


def test_a_cached_prefix_gives_the_same_embedding(model_factory):
    engine = LLMEngine(EngineConfig(model=str(model_factory("llama")), dtype="float32", device="cpu",
                                    num_kv_blocks=64, block_size=4, enable_prefix_caching=True))
    outs = []
    for _ in range(2):
        rid = engine.add_request(PROMPTS[0], PoolingParams())
        while not (out := [o for o in engine.step() if o.finished and o.request_id == rid]):
            pass
        outs.append(out[0])
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == 36  # 9 whole blocks before the last token
    assert outs[1].embedding == outs[0].embedding


def test_bad_embedding_requests_name_their_field(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
              max_model_len=48)
    hidden = llm.engine.model_config.hidden_size
    with pytest.raises(ValueError, match=rf"^prompts\[1\]: dimensions: {hidden + 1} is more than the model's {hidden}"):
        llm.embed(["a", "b"], [PoolingParams(), PoolingParams(dimensions=hidden + 1)])
    with pytest.raises(ValueError, match=r"^prompts\[0\]: prompt: 49 tokens are more than max_model_len=48"):
        llm.embed([[5] * 49])
    assert len(llm.embed([[5] * 48])[0].outputs.embedding) == hidden  # a whole context: nothing is generated
    with pytest.raises(ValueError, match=r"^prompts\[0\]: prompt: is empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="^pooling_params: 1 given for 2 prompts"):
        llm.embed(["a", "b"], [PoolingParams()])
    for kwargs, field in (({"dimensions": 0}, "dimensions"), ({"dimensions": True}, "dimensions"),
                          ({"normalize": 1}, "normalize"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            PoolingParams(**kwargs)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].embedding is None


def test_score_is_the_cosine_of_hf_embeddings_paired_as_vllm_pairs(model_factory, hf_model_cache):
    """vLLM's ``LLM.score``: one first prompt against every second one, or two lists pairwise; each score the
    cosine similarity of the two prompts' embeddings (HF's hidden states)."""
    model_dir = model_factory("llama")
    hf = hf_model_cache(model_dir)
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)

    def cosine(a, b):
        return float(torch.nn.functional.cosine_similarity(_hf_hidden(hf.model, a), _hf_hidden(hf.model, b), dim=0))

    one = llm.score(PROMPTS[0], PROMPTS)
    assert [o.prompt_token_ids for o in one] == PROMPTS
    assert [o.outputs.score for o in one] == pytest.approx([cosine(PROMPTS[0], p) for p in PROMPTS], abs=1e-5)
    assert one[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    pairwise = llm.score(PROMPTS[:2], PROMPTS[1:])
    assert [o.outputs.score for o in pairwise] == pytest.approx([cosine(PROMPTS[0], PROMPTS[1]),
                                                                 cosine(PROMPTS[1], PROMPTS[2])], abs=1e-5)
    assert len({round(o.outputs.score, 4) for o in one}) == 3  # the scores tell the prompts apart
    with pytest.raises(ValueError, match=r"^data_1: 2 prompts for 3 in data_2"):
        llm.score(PROMPTS[:2], PROMPTS)
    with pytest.raises(ValueError, match="^data_2: is empty"):
        llm.score("a", [])
    with pytest.raises(ValueError, match="^pooling_params.normalize"):
        llm.score("a", "b", PoolingParams(normalize=False))
