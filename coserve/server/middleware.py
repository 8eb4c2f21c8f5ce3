"""One ASGI middleware in front of every route: authentication (the caller's tenant), body-size limits,
HTTP metrics and a structured access log. Plain ASGI, so streamed responses pass through untouched."""

from __future__ import annotations

import json
import logging
import re
import time

from starlette.exceptions import HTTPException as StarletteHTTPException

from coserve.server.auth import Authenticator
from coserve.server.errors import APIError
from coserve.server.metrics import ServerMetrics

access_log = logging.getLogger("coserve.access")
OPEN_PATHS = ("/health", "/metrics")  # no key needed
UPLOAD_PATHS = ("/v1/files",)
_IDS = re.compile(r"(file|ftjob|ftckpt|ftevent)-[0-9a-f]+")


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body exceeds the limit of {limit} bytes")


def route_label(path: str) -> str:
    """The path with ids replaced, so that metrics labels stay few."""
    return _IDS.sub(lambda m: f"{{{m.group(1)}_id}}", path) if not path.startswith("/v1/models/") else "/v1/models/{model}"


class ServerMiddleware:
    def __init__(self, app, auth: Authenticator, metrics: ServerMetrics, max_body: int, max_upload: int) -> None:
        self.app, self.auth, self.metrics = app, auth, metrics
        self.max_body, self.max_upload = max_body, max_upload

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        status = {"code": 500}
        tenant = None

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if path not in OPEN_PATHS:
                tenant = self.auth.tenant(headers.get("authorization"))
                scope.setdefault("state", {})["tenant"] = tenant
            limit = self.max_upload if path in UPLOAD_PATHS else self.max_body
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise APIError(413, f"The request body has {length} bytes; the limit is {limit}", code="body_too_large")
            received = 0

            async def limited_receive():
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise BodyTooLarge(limit)
                return message

            await self.app(scope, limited_receive, send_logged)
        except APIError as e:
            await e.response()(scope, receive, send_logged)
        finally:
            ms = (time.perf_counter() - start) * 1000
            self.metrics.http.labels(method, route_label(path), str(status["code"])).inc()
            access_log.info(json.dumps({"method": method, "path": path, "status": status["code"],
                                        "ms": round(ms, 2), "tenant": tenant}))
