"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the right status.

Every client mistake becomes a 4xx here; only a fault of the server itself is a 500 (answered by
``middleware.server_fault``).
"""

from __future__ import annotations

import re
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

T = TypeVar("T")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error to send the client: status, message and, where one field is at fault, its name."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def not_found(what: str, name: str, param: str | None = None) -> APIError:
    return APIError(404, f"The {what} '{name}' does not exist", param, f"{what.replace(' ', '_')}_not_found")


def found(row: T | None, what: str, name: str, param: str | None = None) -> T:
    """``row`` (a tenant's file, job or batch as the store returned it), or a 404 when there is none: another
    tenant's is as absent as one never made."""
    if row is None:
        raise not_found(what, name, param)
    return row


# pydantic names the member of a union that failed in the location (``("stop", "list[str]")``); such a part
# is a type, never a field of ours (fields are snake_case), so it is left out of the field's name
_TYPE_TAG = re.compile(r"(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*(\[.*\])?|function-.*|json-or-python.*)")
_WHOLE_BODY = "The request body must be a JSON object (Content-Type: application/json)"


def _is_tag(part) -> bool:
    return isinstance(part, str) and _TYPE_TAG.fullmatch(part) is not None


def field_name(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages[0].content"``."""
    out = ""
    for p in loc:
        if p in ("body", "query", "path", "header") and not out or _is_tag(p):
            continue
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(errors: list[dict]) -> APIError:
    """One 400 for pydantic's errors: the first field at fault; for a union, what each member wanted (or the
    member that got furthest, when one did)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"The body is not valid JSON: {detail}", None, "invalid_json")
    if loc in ((), ("body",)):
        return APIError(400, _WHOLE_BODY, None, "invalid_body")
    tag = next((i for i, p in enumerate(loc) if i > 0 and _is_tag(p)), None)
    chosen, messages = first, [first["msg"]]
    if tag is not None:  # the other members of the same union
        siblings = [e for e in errors if tuple(e["loc"])[:tag] == loc[:tag] and len(e["loc"]) > tag
                    and _is_tag(e["loc"][tag])]
        chosen = max(siblings, key=lambda e: len(field_name(tuple(e["loc"])) or ""))
        if field_name(tuple(chosen["loc"])) == field_name(loc):
            messages = list(dict.fromkeys(e["msg"] for e in siblings))
        else:
            messages = [chosen["msg"]]
    param = field_name(tuple(chosen["loc"]))
    message = messages[0]
    for m in messages[1:]:
        message += " or " + m.removeprefix("Input should be ") if m.startswith("Input should be ") else f" or {m}"
    return APIError(400, f"{param}: {message}" if param else message, param, "invalid_value")


def install(app: FastAPI) -> None:
    """Turn every exception a route can raise into an OpenAI-shaped response."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        return APIError(exc.status_code, message).response()
