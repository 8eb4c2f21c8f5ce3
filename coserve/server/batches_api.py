"""OpenAI-compatible batches: ``/v1/batches`` (create, retrieve, list, cancel); ``batches.py`` runs them."""

from __future__ import annotations

import asyncio
import secrets
import time

from fastapi import APIRouter, Depends, Query, Request

from coserve.server.batch_files import ENDPOINTS, parse_batch_jsonl
from coserve.server.batches import FINISHED
from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.errors import APIError, bad_request, found
from coserve.server.json_text import TextJSONRoute
from coserve.server.protocol import BatchRequest, list_page

router = APIRouter(route_class=TextJSONRoute)
WINDOWS = ("24h",)  # OpenAI's only completion window
MAX_PAGE = 100


@router.post("/v1/batches")
async def create_batch(body: BatchRequest, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    if body.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}", "endpoint")
    if body.completion_window not in WINDOWS:
        raise bad_request(f"completion_window: must be '24h', got {body.completion_window!r}", "completion_window")
    source = found(ctx.store.get_file(tenant, body.input_file_id), "file", body.input_file_id, "input_file_id")
    if source["purpose"] != "batch":
        raise bad_request(f"input_file_id: the file's purpose is {source['purpose']!r}, not 'batch'", "input_file_id")
    data = await asyncio.to_thread(ctx.store.file_path(body.input_file_id).read_bytes)
    try:
        lines = await asyncio.to_thread(parse_batch_jsonl, data)
    except ValueError as e:
        raise bad_request(f"input_file_id: {e}", "input_file_id", "invalid_file") from e
    for number, line in enumerate(lines, 1):
        if line.url != body.endpoint:
            raise bad_request(f"input_file_id: request {number} ({line.custom_id!r}) is for {line.url}, not the "
                              f"batch's endpoint {body.endpoint}", "input_file_id")
    now = int(time.time())
    batch = {"id": f"batch_{secrets.token_hex(12)}", "object": "batch", "endpoint": body.endpoint, "errors": None,
             "input_file_id": body.input_file_id, "completion_window": body.completion_window,
             "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
             "in_progress_at": None, "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None,
             "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
             "request_counts": {"total": len(lines), "completed": 0, "failed": 0}, "metadata": body.metadata}
    batch = await asyncio.to_thread(ctx.store.add_batch, tenant, batch)
    ctx.batches.submit(tenant, batch["id"])
    return batch


def _own(ctx: ServerContext, request: Request, batch_id: str) -> dict:
    return found(ctx.store.get_batch(tenant_of(request), batch_id), "batch", batch_id, "batch_id")


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request, ctx: ServerContext = Depends(context)):
    return _own(ctx, request, batch_id)


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = Query(20),
                       ctx: ServerContext = Depends(context)):
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit: must be between 1 and {MAX_PAGE}, got {limit}", "limit")
    try:
        page, more = ctx.store.list_batches(tenant_of(request), after, limit)
    except ValueError as e:
        raise bad_request(str(e), "after") from e
    return list_page(page, more)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, ctx: ServerContext = Depends(context)):
    batch = _own(ctx, request, batch_id)
    if batch["status"] in FINISHED:
        raise APIError(409, f"The batch is already {batch['status']} and cannot be cancelled", "batch_id",
                       "batch_not_cancellable")
    if batch["status"] == "cancelling":
        return batch
    return ctx.batches.cancel(batch_id)
