"""The generation routes' lean path answers every body as the FastAPI route it stands in front of would: the
same endpoint function behind both, FastAPI's own answer as the oracle."""

from __future__ import annotations

import json

import pytest
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.testclient import TestClient
from starlette.routing import Match, Route

from coserve.server import errors, lean_routes
from coserve.server.context import context
from coserve.server.protocol import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def chat(body: ChatCompletionRequest, request: Request, ctx=Depends(context)):
    """Echoes what the route got, as the server's endpoints take it."""
    return {"model": body.model, "max_tokens": body.max_tokens, "n": body.n, "ctx": ctx}


async def completion(body: CompletionRequest, request: Request, ctx=Depends(context)):
    return {"prompt": body.prompt, "stream": body.stream}


def app_with(lean: bool) -> FastAPI:
    app = FastAPI()
    app.state.coserve = "the context"
    errors.install(app)
    app.post("/chat")(chat)
    app.post("/completions")(completion)
    if lean:
        lean_routes.install(app, [app.router], [chat, completion])
    return app


@pytest.fixture(scope="module")
def clients():
    with TestClient(app_with(False)) as plain, TestClient(app_with(True)) as lean:
        yield plain, lean


BODIES = [
    ("/chat", CHAT, "application/json"),
    ("/chat", {**CHAT, "n": 3, "max_tokens": "7"}, "application/json; charset=utf-8"),  # lax as FastAPI is
    ("/chat", CHAT, "application/vnd.api+json"),
    ("/chat", b"", "application/json"),
    ("/chat", b"[1, 2]", "application/json"),
    ("/chat", b"null", "application/json"),
    ("/chat", b"{not json", "application/json"),
    ("/chat", b'{"model": "\xff\xfe"}', "application/json"),
    ("/chat", CHAT, "text/plain"),
    ("/chat", CHAT, None),
    ("/chat", b"model=m", "application/x-www-form-urlencoded"),
    ("/chat", {**CHAT, "max_tokens": -1}, "application/json"),
    ("/chat", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "application/json"),
    ("/chat", {**CHAT, "messages": "hi"}, "application/json"),
    ("/chat", {"messages": CHAT["messages"]}, "application/json"),
    ("/chat", {**CHAT, "temperature": "hot"}, "application/json"),
    ("/completions", {"model": "m", "prompt": [1, 2, 3]}, "application/json"),
    ("/completions", {"model": "m", "prompt": {"a": 1}}, "application/json"),
    ("/completions", {"model": "m", "prompt": "hi", "stream": "yes"}, "application/json"),
]


@pytest.mark.parametrize("path, body, content_type", BODIES)
def test_the_lean_route_answers_as_fastapi_does(clients, path, body, content_type):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": content_type} if content_type else {}
    plain, lean = (c.post(path, content=content, headers=headers) for c in clients)
    assert (lean.status_code, lean.json()) == (plain.status_code, plain.json())
    if lean.status_code == 200 and path == "/chat":
        assert lean.json()["ctx"] == "the context"  # the server's context, as Depends(context) gives it


def test_other_methods_still_reach_the_fastapi_routes(clients):
    plain, lean = (c.get("/chat") for c in clients)
    assert lean.status_code == plain.status_code == 405


def test_the_lean_routes_come_first_and_the_schema_keeps_the_fastapi_ones():
    app = app_with(True)
    assert [getattr(r, "path", None) for r in app.router.routes[:2]] == ["/chat", "/completions"]
    assert {"/chat", "/completions"} <= set(app.openapi()["paths"])


def test_an_endpoint_without_a_post_route_is_refused_naming_it():
    with pytest.raises(ValueError, match="no POST route for completion"):
        lean_routes.install(FastAPI(), [APIRouter()], [completion])


@pytest.mark.parametrize("content_type, expected", [
    ("application/json", True), ("Application/JSON; charset=utf-8", True), ("application/problem+json", True),
    ("text/json", False), ("application/jsonl", False), ("text/plain", False), ("", False), (None, False)])
def test_is_json(content_type, expected):
    assert lean_routes.is_json(content_type) is expected


def test_the_server_answers_its_generation_routes_on_the_lean_path(model_factory, tmp_path):
    """``build_app`` puts the generation routes on the lean path: for each, the first route the router finds
    matching a POST is a lean one; a chat is answered through it, and a bad one refused."""
    from coserve.engine.config import EngineConfig
    from coserve.server.app import build_app
    from coserve.server.config import ServerConfig

    model_dir = model_factory("llama")
    app = build_app(ServerConfig(model=str(model_dir), state_dir=str(tmp_path / "state")),
                    EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4))
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"):
        scope = {"type": "http", "path": path, "method": "POST", "root_path": ""}
        first = next(r for r in app.router.routes if r.matches(scope)[0] == Match.FULL)
        assert type(first) is Route and first.path == path
    with TestClient(app) as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "model": model_dir.name})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        assert r.json()["usage"]["completion_tokens"] == 2
        bad = http.post("/v1/chat/completions", json={**CHAT, "model": model_dir.name, "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
