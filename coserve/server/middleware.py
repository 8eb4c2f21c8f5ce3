"""One ASGI middleware in front of every route: authentication (the caller's tenant), body-size limits,
HTTP metrics and a structured access log. Plain ASGI, so streamed responses pass through untouched."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from coserve.server.auth import Authenticator
from coserve.server.errors import APIError
from coserve.server.metrics import ServerMetrics

log = logging.getLogger("coserve.server")
ACCESS_LOGGER = "coserve.access"  # one JSON object per request, at INFO
access_log = logging.getLogger(ACCESS_LOGGER)
OPEN_PATHS = ("/health", "/metrics", "/version")  # no key needed
INTERNAL_TENANT = "coserve.tenant"  # a scope key of the server's own in-process calls (batches): their tenant.
# A request from the network cannot set it: its scope is built by the HTTP server from the wire.
UPLOAD_PATHS = ("/v1/files",)  # and an upload's parts (is_upload)
UNROUTED = "(unrouted)"  # the metrics label of a request that matched no route (or was refused before routing)


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body exceeds the limit of {limit} bytes")


def is_upload(path: str) -> bool:
    """A request whose body is a file (or a part of one): ``--max-upload-bytes`` bounds it, not ``--max-body-bytes``."""
    return path in UPLOAD_PATHS or (path.startswith("/v1/uploads/") and path.endswith("/parts"))


def route_label(scope) -> str:
    """The matched route's template (``/v1/files/{file_id}``): labels stay few whatever paths clients send."""
    route = scope.get("route")
    return getattr(route, "path", None) or UNROUTED


def server_fault(exc: BaseException, engine_error: BaseException | None) -> APIError:
    """The response for an exception no route turned into an APIError: 503 once the engine has stopped, else 500."""
    if engine_error is not None:
        return APIError(503, f"The engine has stopped ({engine_error!r}); the server must be restarted",
                        code="engine_stopped")
    log.error("internal error", exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__})", type="server_error")


class ServerMiddleware:
    """Also the last line for unexpected exceptions: answered here in OpenAI's shape (Starlette's own handler
    would answer, then re-raise, and the server would drop the connection)."""

    def __init__(self, app, auth: Authenticator, metrics: ServerMetrics, max_body: int, max_upload: int,
                 engine_error: Callable[[], BaseException | None] = lambda: None) -> None:
        self.app, self.auth, self.metrics = app, auth, metrics
        self.max_body, self.max_upload = max_body, max_upload
        self.engine_error = engine_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        status = {"code": 500, "started": False}
        tenant = None

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)

        try:
            state = scope.setdefault("state", {})
            state["arrived"] = start  # a Job's arrival (its TTFT starts here)
            if INTERNAL_TENANT in scope:
                tenant = state["tenant"] = scope[INTERNAL_TENANT]
            elif path not in OPEN_PATHS:
                tenant = state["tenant"] = self.auth.tenant(headers.get("authorization"))
            limit = self.max_upload if is_upload(path) else self.max_body
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
        except ClientDisconnect:  # nobody to answer
            status["code"] = 499
        except Exception as e:
            if status["started"]:
                raise
            await server_fault(e, self.engine_error()).response()(scope, receive, send_logged)
        finally:
            ms = (time.monotonic() - start) * 1000
            self.metrics.http.labels(method, route_label(scope), str(status["code"])).inc()
            if access_log.isEnabledFor(logging.INFO):
                record = {"method": method, "path": path, "status": status["code"], "ms": round(ms, 2),
                          "tenant": tenant}
                job = scope.get("state", {}).get("job")  # a generation's id, tokens and TTFT (choices.new_job)
                if job is not None:
                    record.update(job.log_fields())
                access_log.info(json.dumps(record))
