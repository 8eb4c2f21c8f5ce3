"""``POST /v1/embeddings`` on a live server, through the official ``openai`` client (and httpx for vLLM's extensions):
embeddings against HF transformers and HF PEFT, in both encodings, and every bad request a 4xx naming its field."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from transformers import AutoModel, AutoTokenizer

from peft_helpers import make_lora_adapter, peft_model
from server_helpers import start_server

KEY = "key-alice"
BASE = "tiny-llama"
TEXTS = ["The scheduler decides", "Co-serving finetuning and inference", "a"]


@pytest.fixture(scope="module")
def served(model_factory, tmp_path_factory):
    model = model_factory("llama")
    root = tmp_path_factory.mktemp("serve-embed")
    adapter = make_lora_adapter(model, root / "lora", r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    keys = root / "keys.txt"
    keys.write_text(f"{KEY} alice\n")
    srv = start_server(model, root / "state", "--api-keys", str(keys), "--served-model-name", BASE,
                       "--adapter", f"tuned={adapter}", "--max-model-len", "64", "--max-waiting-requests", "6")
    yield srv, model, adapter
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=f"{served[0].url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _hf(decoder, ids: list[int], dimensions: int | None = None) -> torch.Tensor:
    with torch.inference_mode():
        h = decoder(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(h[:dimensions] if dimensions else h, dim=0)


def test_embeddings_match_hf_in_both_encodings(served, client):
    _, model, _ = served
    tokenizer, hf = AutoTokenizer.from_pretrained(str(model)), AutoModel.from_pretrained(str(model)).eval()
    reply = client.embeddings.create(model=BASE, input=TEXTS)  # the client asks for base64 and decodes it
    as_floats = client.embeddings.create(model=BASE, input=TEXTS, encoding_format="float")
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert reply.object == "list" and reply.model == BASE and [d.index for d in reply.data] == [0, 1, 2]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(i) for i in ids)
    for d, f, i in zip(reply.data, as_floats.data, ids):
        assert d.object == "embedding" and d.embedding == f.embedding  # float32 values, exactly, either way
        assert torch.allclose(torch.tensor(d.embedding), _hf(hf, i), atol=1e-5)
    tokens = client.embeddings.create(model=BASE, input=ids[1], encoding_format="float")  # token ids, one prompt
    assert tokens.data[0].embedding == as_floats.data[1].embedding
    short = client.embeddings.create(model=BASE, input=TEXTS[0], dimensions=16, encoding_format="float")
    assert len(short.data[0].embedding) == 16
    assert torch.allclose(torch.tensor(short.data[0].embedding), _hf(hf, ids[0], 16), atol=1e-5)


def test_an_adapter_and_a_conversation_embed_as_their_oracles(served, client):
    _, model, adapter = served
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer(TEXTS[1])["input_ids"]
    tuned = client.embeddings.create(model="tuned", input=TEXTS[1], encoding_format="float").data[0].embedding
    oracle = peft_model(model, adapter)
    assert torch.allclose(torch.tensor(tuned), _hf(oracle.base_model.model.model, ids), atol=1e-5)
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi."}]
    chat = httpx.post(f"{served[0].url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": BASE, "messages": messages, "encoding_format": "float"}, timeout=60)
    assert chat.status_code == 200, chat.text
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    chat_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert chat.json()["usage"]["prompt_tokens"] == len(chat_ids)
    with oracle.disable_adapter():
        base = _hf(oracle.base_model.model.model, chat_ids)
    assert torch.allclose(torch.tensor(chat.json()["data"][0]["embedding"]), base, atol=1e-5)


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "dimensions": 10_000}, 400, "dimensions"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "input"),
    ({"input": [5] * 65}, 400, "input"),
    ({"input": [10**9]}, 400, "input"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": ["x"] * 7}, 400, "input"),
    ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"input": "x", "model": "nope"}, 404, "model"),
])
def test_bad_embedding_requests_name_their_field(served, body, status, param):
    reply = httpx.post(f"{served[0].url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": BASE, **body}, timeout=60)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_a_whole_context_embeds_and_errors_keep_the_server_serving(client):
    whole = client.embeddings.create(model=BASE, input=[[5] * 64], encoding_format="float")  # nothing is generated
    assert whole.usage.prompt_tokens == 64
    kept = client.embeddings.create(model=BASE, input=[[6] * 70], encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 64})
    assert kept.usage.prompt_tokens == 64
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).embeddings.create(model=BASE, input="x")
    assert client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3).choices[0].finish_reason in ("length", "stop")


def test_a_batch_of_embeddings_gives_the_single_requests_embeddings(client):
    lines = [{"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": BASE, "input": text, "encoding_format": "float"}} for i, text in enumerate(TEXTS)]
    source = client.files.create(file=("batch.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed") and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == len(TEXTS)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    single = client.embeddings.create(model=BASE, input=TEXTS, encoding_format="float")
    assert [r["custom_id"] for r in out] == [x["custom_id"] for x in lines]
    assert [r["response"]["body"]["data"][0]["embedding"] for r in out] == [d.embedding for d in single.data]


def _post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served[0].url}{path}", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": BASE, **body}, timeout=60)


def test_score_and_rerank_are_the_cosine_similarities_of_the_embeddings(served, client):
    vectors = [torch.tensor(d.embedding, dtype=torch.float64)
               for d in client.embeddings.create(model=BASE, input=TEXTS, encoding_format="float").data]
    one_to_many = _post(served, "/score", {"text_1": TEXTS[0], "text_2": TEXTS})
    assert one_to_many.status_code == 200, one_to_many.text
    want = [float(vectors[0] @ v) for v in vectors]
    assert [d["score"] for d in one_to_many.json()["data"]] == pytest.approx(want, abs=1e-12)
    assert one_to_many.json()["data"][0]["score"] == pytest.approx(1.0, abs=1e-6)  # a text with itself
    pairwise = _post(served, "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    assert [d["index"] for d in pairwise["data"]] == [0, 1]
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [float(vectors[0] @ vectors[1]), float(vectors[1] @ vectors[2])], abs=1e-12)
    ranked = _post(served, "/v1/rerank", {"query": TEXTS[1], "documents": TEXTS, "top_n": 2})
    assert ranked.status_code == 200, ranked.text
    order = sorted(range(3), key=lambda i: -float(vectors[1] @ vectors[i]))[:2]
    results = ranked.json()["results"]
    assert [r["index"] for r in results] == order and order[0] == 1  # the query itself is the best match
    assert [r["document"]["text"] for r in results] == [TEXTS[i] for i in order]
    assert results[1]["relevance_score"] == pytest.approx(float(vectors[1] @ vectors[order[1]]), abs=1e-12)
    assert len(_post(served, "/rerank", {"query": "a", "documents": TEXTS}).json()["results"]) == 3  # top_n 0: all


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ("/score", {"text_1": [], "text_2": "a"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": ["a", ""]}, "text_2"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/rerank", {"query": "a", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "a", "documents": ["a"] * 6}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["a"], "model": "nope"}, "model"),
])
def test_bad_score_and_rerank_requests_name_their_field(served, path, body, param):
    reply = _post(served, path, body)
    assert 400 <= reply.status_code < 500, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
