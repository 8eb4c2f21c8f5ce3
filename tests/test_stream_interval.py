"""``--stream-interval N``: a streamed response hears of its first token at once, then of every N new tokens,
then of its end; the text and logprobs it sends are those of a stream of every token. A response sent whole
hears of its first token and its end only."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from coserve.engine.config import EngineConfig
from coserve.server import generation
from coserve.server.app import build_app
from coserve.server.config import ServerConfig


def _app(model_dir, tmp_path, interval: int):
    return build_app(ServerConfig(model=str(model_dir), state_dir=str(tmp_path / f"state{interval}"),
                                  stream_interval=interval),
                     EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4))


def _events(http, body) -> list[dict]:
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
        lines = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert s.status_code == 200 and lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_events_come_every_n_tokens_after_the_first_with_the_same_text_and_logprobs(model_factory, tmp_path):
    model_dir = model_factory("llama")
    body = {"model": model_dir.name, "prompt": "hello there", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    streams = {}
    for interval in (1, 4):
        with TestClient(_app(model_dir, tmp_path, interval)) as http:
            events = _events(http, body)
            whole = http.post("/v1/completions", json=body).json()["choices"][0]
        tokens = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e["choices"][0]["logprobs"]]
        text = "".join(e["choices"][0]["text"] for e in events)
        logprobs = [lp for e in events if e["choices"][0]["logprobs"]
                    for lp in e["choices"][0]["logprobs"]["token_logprobs"]]
        assert text == whole["text"] and logprobs == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-5)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        streams[interval] = (tokens, text, logprobs)
    assert streams[1][0] == [1] * 10
    assert streams[4][0] == [1, 4, 4, 1]  # the first token, two of four, and the last one with the end
    assert streams[4][1:] == streams[1][1:]


def test_a_response_sent_whole_hears_of_its_first_token_and_its_end_only(model_factory, tmp_path, monkeypatch):
    model_dir = model_factory("llama")
    heard = []
    original = generation.RequestStream.__anext__

    async def counting(self):
        out = await original(self)
        heard.append(len(out.outputs[0].token_ids))
        return out
    monkeypatch.setattr(generation.RequestStream, "__anext__", counting)
    body = {"model": model_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
            "temperature": 0, "ignore_eos": True}
    with TestClient(_app(model_dir, tmp_path, 1)) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
        assert heard == [1, 7]
        heard.clear()
        with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as s:
            assert s.status_code == 200 and list(s.iter_lines())
        assert heard == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("interval", [0, -2])
def test_a_stream_interval_below_one_is_refused_naming_the_flag(interval):
    with pytest.raises(ValueError, match="--stream-interval"):
        ServerConfig(model="m", state_dir="s", stream_interval=interval)
