"""OpenAI-compatible files and fine-tuning jobs: ``/v1/files`` and ``/v1/fine_tuning/jobs``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.errors import APIError, bad_request, found
from coserve.server.json_text import TextJSONRoute
from coserve.server.paging import check_limit, metadata_filter, page_after
from coserve.server.protocol import FineTuningJobRequest
from coserve.server.batch_files import parse_batch_jsonl
from coserve.server.batches import ACTIVE
from coserve.server.eval_data import parse_eval_jsonl
from coserve.server.training_files import PURPOSES, validate_training_jsonl

router = APIRouter(route_class=TextJSONRoute)
MAX_PAGE = 100
MAX_FILES_PAGE = 10_000  # OpenAI's limit for GET /v1/files
UPLOAD_PURPOSES = (*PURPOSES, "batch", "evals")  # batch_output files are the server's own
VALIDATORS = {"batch": parse_batch_jsonl, "evals": parse_eval_jsonl}  # fine-tune: validate_training_jsonl


async def _multipart(request: Request):
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("file: send the file as multipart/form-data with fields 'file' and 'purpose'", "file")
    try:
        return await request.form(max_files=1, max_fields=8)
    except StarletteHTTPException:
        raise
    except Exception as e:  # the multipart parser raises several kinds for a malformed body
        raise bad_request(f"file: the multipart body cannot be read ({e})", "file") from e


@router.post("/v1/files")
async def upload_file(request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    form = await _multipart(request)
    purpose = form.get("purpose")
    upload = form.get("file")
    if not isinstance(purpose, str):
        raise bad_request("purpose: is required ('fine-tune', 'batch' or 'evals')", "purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise bad_request(f"purpose: '{purpose}' is not supported; use 'fine-tune', 'batch' or 'evals'", "purpose")
    if upload is None or isinstance(upload, str):
        raise bad_request("file: is required (a JSONL file: the chat format, or batch requests)", "file")
    data = await upload.read()
    await upload.close()
    if len(data) > ctx.config.max_upload_bytes:
        raise APIError(413, f"file: {len(data)} bytes exceeds the limit of {ctx.config.max_upload_bytes}", "file",
                       "file_too_large")
    try:
        await asyncio.to_thread(VALIDATORS.get(purpose, validate_training_jsonl), data)
    except ValueError as e:
        raise bad_request(f"file: {e}", "file", "invalid_file") from e
    filename = (upload.filename or "upload.jsonl").replace("/", "_").replace("\\", "_")[:255]
    return await asyncio.to_thread(ctx.store.add_file, tenant, filename, purpose, data)


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(MAX_FILES_PAGE), order: str = Query("desc"),
                     ctx: ServerContext = Depends(context)):
    """OpenAI's paging: ``limit`` files after the file ``after``, newest first (``order=desc``) or oldest first."""
    check_limit(limit, MAX_FILES_PAGE)
    if order not in ("asc", "desc"):
        raise bad_request(f"order: must be 'asc' or 'desc', got {order!r}", "order")
    files = ctx.store.list_files(tenant_of(request), purpose)
    if order == "asc":
        files.reverse()
    page, more = page_after(files, after, limit, "a file of this tenant")
    return {"object": "list", "data": page, "has_more": more}


def _own_file(ctx: ServerContext, request: Request, file_id: str) -> dict:
    return found(ctx.store.get_file(tenant_of(request), file_id), "file", file_id, "file_id")


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request, ctx: ServerContext = Depends(context)):
    return _own_file(ctx, request, file_id)


@router.get("/v1/files/{file_id}/content")
async def get_file_content(file_id: str, request: Request, ctx: ServerContext = Depends(context)):
    _own_file(ctx, request, file_id)
    return FileResponse(ctx.store.file_path(file_id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    using = [b["id"] for t, b in ctx.store.batches_with_status(*ACTIVE) if t == tenant and b["input_file_id"] == file_id]
    if using:
        raise APIError(409, f"The file is in use by batch {using[0]}", "file_id", "file_in_use")
    await asyncio.to_thread(ctx.jobs.delete_file, tenant, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/v1/fine_tuning/jobs")
async def create_job(body: FineTuningJobRequest, request: Request, ctx: ServerContext = Depends(context)):
    return await asyncio.to_thread(ctx.jobs.create, tenant_of(request), body)


def _limit(limit: int) -> int:
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit: must be between 1 and {MAX_PAGE}, got {limit}", "limit")
    return limit


def _page(fn, *args, after: str | None, limit: int) -> dict:
    try:
        data, has_more = fn(*args, after=after, limit=_limit(limit))
    except ValueError as e:
        raise bad_request(str(e), "after") from e
    return {"object": "list", "data": data, "has_more": has_more}


@router.get("/v1/fine_tuning/jobs")
async def list_jobs(request: Request, after: str | None = None, limit: int = Query(20),
                    ctx: ServerContext = Depends(context)):
    return _page(ctx.store.list_jobs, tenant_of(request), *metadata_filter(request), after=after, limit=limit)


def _own_job(ctx: ServerContext, request: Request, job_id: str) -> dict:
    return ctx.jobs.owned(tenant_of(request), job_id)


@router.get("/v1/fine_tuning/jobs/{job_id}")
async def get_job(job_id: str, request: Request, ctx: ServerContext = Depends(context)):
    return _own_job(ctx, request, job_id)


@router.post("/v1/fine_tuning/jobs/{job_id}/cancel")
async def cancel_job(job_id: str, request: Request, ctx: ServerContext = Depends(context)):
    return await asyncio.to_thread(ctx.jobs.cancel, tenant_of(request), job_id)


@router.post("/v1/fine_tuning/jobs/{job_id}/pause")
async def pause_job(job_id: str, request: Request, ctx: ServerContext = Depends(context)):
    return await asyncio.to_thread(ctx.jobs.pause, tenant_of(request), job_id)


@router.post("/v1/fine_tuning/jobs/{job_id}/resume")
async def resume_job(job_id: str, request: Request, ctx: ServerContext = Depends(context)):
    return await asyncio.to_thread(ctx.jobs.resume, tenant_of(request), job_id)


@router.get("/v1/fine_tuning/jobs/{job_id}/events")
async def job_events(job_id: str, request: Request, after: str | None = None, limit: int = Query(20),
                     ctx: ServerContext = Depends(context)):
    _own_job(ctx, request, job_id)
    return _page(ctx.store.list_events, job_id, after=after, limit=limit)


@router.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")
async def job_checkpoints(job_id: str, request: Request, after: str | None = None, limit: int = Query(10),
                          ctx: ServerContext = Depends(context)):
    _own_job(ctx, request, job_id)
    return _page(ctx.store.list_checkpoints, job_id, after=after, limit=limit)
