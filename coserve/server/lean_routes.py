"""The generation routes as plain Starlette routes in front of their FastAPI ones.

A generation's time before the engine is on its TTFT. FastAPI's per-request machinery (its body reading and
content-type parsing, dependency solving, routing through nested routers) took 0.4 ms of the 1.2 ms a streamed
chat spent in the server before the engine on a 2-core Xeon (``docs/benchmark-history.md``). A lean route does
only what those routes need: it reads the body, parses it as FastAPI does (JSON under a JSON content type, its
strings Unicode text as ``json_text`` checks for every route, validated into the endpoint's own pydantic model, in
Python mode), and calls the same endpoint function with the server's context. Errors are the same ``APIError`` s FastAPI's would have become (``errors.validation_error``).
The FastAPI route stays behind it for the OpenAPI schema; the router matches the lean one first.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable

import pydantic
from fastapi import APIRouter, FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.routing import Route

from coserve.server.errors import APIError, validation_error
from coserve.server.json_text import check_text, is_json

WHOLE_BODY_ERROR = [{"loc": ("body",), "msg": "Field required", "type": "missing"}]  # FastAPI's, for no JSON body


def parse_body(model: type[pydantic.BaseModel], raw: bytes, content_type: str | None) -> pydantic.BaseModel:
    """``raw`` as ``model``, or the ``APIError`` FastAPI's validation would have produced."""
    if not raw or not is_json(content_type):
        raise validation_error(WHOLE_BODY_ERROR)
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise validation_error([{"loc": ("body", e.pos), "msg": "JSON decode error", "type": "json_invalid",
                                 "ctx": {"error": e.msg}}]) from e
    except (UnicodeDecodeError, RecursionError) as e:  # bytes that are no UTF-8 text (json.loads decodes them
        # first), or arrays and objects nested deeper than the parser recurses: FastAPI's answer
        raise APIError(400, "There was an error parsing the body") from e
    check_text(raw, data)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(list(e.errors())) from e


def lean_route(path: str, endpoint: Callable) -> Route:
    """A POST route for ``path`` that calls ``endpoint(body, request, ctx)`` (a FastAPI endpoint of this server's),
    with the body parsed into the endpoint's ``body`` annotation; what it returns is sent as FastAPI sends it (a
    response as it is, anything else as JSON)."""
    model = typing.get_type_hints(endpoint)["body"]

    async def handle(request: Request) -> Response:
        body = parse_body(model, await request.body(), request.headers.get("content-type"))
        out = await endpoint(body, request, request.app.state.coserve)
        return out if isinstance(out, Response) else JSONResponse(jsonable_encoder(out))  # as FastAPI sends it

    return Route(path, handle, methods=["POST"], name=endpoint.__name__)


def install(app: FastAPI, routers: list[APIRouter], endpoints: list[Callable]) -> None:
    """Put a lean route for each of ``endpoints``, at the path its POST route in ``routers`` has, in front of every
    other route (that FastAPI route included)."""
    paths = {r.endpoint: r.path for router in routers for r in router.routes
             if isinstance(r, APIRoute) and "POST" in r.methods}
    missing = [e.__name__ for e in endpoints if e not in paths]
    if missing:
        raise ValueError(f"lean_routes.install: no POST route for {', '.join(missing)}")
    app.router.routes[:0] = [lean_route(paths[e], e) for e in endpoints]
