"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the right status.

Every client mistake becomes a 4xx here; only a fault of the server itself is a 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("coserve.server")

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


def field_name(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p and not str(p).startswith(("function-", "union[", "literal[", "json-or-python")):
            out += f".{p}" if out else str(p)
    return out or None


def install(app: FastAPI) -> None:
    """Turn every exception a route can raise into an OpenAI-shaped response."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = field_name(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            return APIError(400, f"The body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                            None, "invalid_json").response()
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return APIError(400, message, param, "invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _server_fault(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(exc).__name__})", type="server_error").response()
