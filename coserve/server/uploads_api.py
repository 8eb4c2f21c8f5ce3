"""OpenAI's Uploads API: a file too large for one request sent in parts, then made one file.

``POST /v1/uploads`` opens an upload (``filename``, ``purpose``, ``bytes``, ``mime_type``) for an hour;
``POST /v1/uploads/{id}/parts`` adds a part (multipart field ``data``, at most ``--max-upload-bytes`` each);
``POST /v1/uploads/{id}/complete`` joins the parts named in ``part_ids``, in that order, into a file (checked against
``bytes`` and an optional ``md5``, then validated as ``POST /v1/files`` validates), and
``POST /v1/uploads/{id}/cancel`` drops them. Parts lie in the state directory, so an upload survives a restart.
The file made from an upload has an id derived from the upload's: completing again after a crash finds it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from fastapi import APIRouter, Depends, Request
from pydantic import Field

from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.errors import APIError, bad_request, found
from coserve.server.fine_tuning_api import UPLOAD_PURPOSES, VALIDATORS
from coserve.server.json_text import TextJSONRoute
from coserve.server.protocol import Body
from coserve.server.store import Store
from coserve.server.training_files import validate_training_jsonl

router = APIRouter(route_class=TextJSONRoute)
EXPIRES_S = 3600  # OpenAI's: an upload not completed within an hour expires
MIME_TYPES = ("application/jsonl", "application/x-jsonl", "application/json", "application/x-ndjson", "text/jsonl",
              "text/plain")  # the files of either purpose are JSONL


class UploadRequest(Body):
    filename: str = Field(min_length=1, max_length=255)
    purpose: str
    bytes: int = Field(ge=1)
    mime_type: str
    expires_after: dict | None = None


class CompleteRequest(Body):
    part_ids: list[str] = Field(min_length=1)
    md5: str | None = None


def expire_overdue(store: Store, now: float | None = None) -> int:
    """Pending uploads past their hour become ``expired`` and their parts are dropped; how many."""
    now = time.time() if now is None else now
    overdue = [u for u in store.uploads_with_status("pending") if u["expires_at"] <= now]
    for upload in overdue:
        store.update_upload(upload["id"], "pending", status="expired")
    return len(overdue)


def _own_upload(ctx: ServerContext, request: Request, upload_id: str) -> dict:
    """The caller's upload (404 otherwise); one found overdue expires now."""
    upload = found(ctx.store.get_upload(tenant_of(request), upload_id), "upload", upload_id, "upload_id")
    if upload["status"] == "pending" and upload["expires_at"] <= time.time():
        upload = ctx.store.update_upload(upload_id, "pending", status="expired") or ctx.store.get_upload(
            None, upload_id)
    return upload


def _not_pending(upload: dict) -> APIError:
    return APIError(409, f"The upload is {upload['status']}; only a pending upload takes parts, completes or is "
                    "cancelled", "upload_id", "upload_not_pending")


@router.post("/v1/uploads")
async def create_upload(body: UploadRequest, request: Request, ctx: ServerContext = Depends(context)):
    if body.purpose not in UPLOAD_PURPOSES:
        raise bad_request(f"purpose: '{body.purpose}' is not supported; use 'fine-tune', 'batch' or 'evals'",
                          "purpose")
    if body.mime_type not in MIME_TYPES:
        raise bad_request(f"mime_type: '{body.mime_type}' is not a type of JSONL files ({', '.join(MIME_TYPES)})",
                          "mime_type")
    if body.bytes > ctx.config.max_file_bytes:
        raise APIError(413, f"bytes: {body.bytes} exceeds the limit of {ctx.config.max_file_bytes} for a file",
                       "bytes", "file_too_large")
    if body.expires_after is not None:
        raise bad_request("expires_after: files do not expire on this server (delete them with DELETE "
                          "/v1/files/{id})", "expires_after")
    await asyncio.to_thread(expire_overdue, ctx.store)
    now = int(time.time())
    upload = {"id": Store.new_id("upload"), "object": "upload", "bytes": body.bytes, "created_at": now,
              "filename": body.filename.replace("/", "_").replace("\\", "_"), "purpose": body.purpose,
              "status": "pending", "expires_at": now + EXPIRES_S, "file": None}
    return await asyncio.to_thread(ctx.store.add_upload, tenant_of(request), upload)


@router.post("/v1/uploads/{upload_id}/parts")
async def add_part(upload_id: str, request: Request, ctx: ServerContext = Depends(context)):
    upload = _own_upload(ctx, request, upload_id)
    if upload["status"] != "pending":
        raise _not_pending(upload)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("data: send the part as multipart/form-data with the field 'data'", "data")
    try:
        form = await request.form(max_files=1, max_fields=4)
    except Exception as e:  # the multipart parser raises several kinds for a malformed body
        raise bad_request(f"data: the multipart body cannot be read ({e})", "data") from e
    part = form.get("data")
    if part is None or isinstance(part, str):
        raise bad_request("data: is required (a chunk of the file's bytes)", "data")
    data = await part.read()
    await part.close()
    if not data:
        raise bad_request("data: the part is empty", "data")
    try:
        made = await asyncio.to_thread(ctx.store.add_upload_part, upload_id, data, upload["bytes"])
    except ValueError as e:
        raise bad_request(str(e), "data") from e
    if made is None:  # completed, cancelled or expired meanwhile
        raise _not_pending(ctx.store.get_upload(None, upload_id))
    return made


def _joined(store: Store, upload: dict, part_ids: list[str], md5: str | None) -> bytes:
    """The named parts' bytes in order, checked against the upload's size and ``md5``; errors name the field."""
    parts = store.upload_parts(upload["id"])
    for i, part_id in enumerate(part_ids):
        if part_id not in parts:
            raise bad_request(f"part_ids[{i}]: '{part_id}' is not a part of this upload", f"part_ids[{i}]")
        if part_id in part_ids[:i]:
            raise bad_request(f"part_ids[{i}]: '{part_id}' is named twice", f"part_ids[{i}]")
    total = sum(parts[p] for p in part_ids)
    if total != upload["bytes"]:
        raise bad_request(f"part_ids: the parts hold {total} bytes; the upload was created for {upload['bytes']}",
                          "part_ids")
    folder = store.upload_dir(upload["id"])
    data = b"".join((folder / p).read_bytes() for p in part_ids)
    if md5 is not None and (digest := hashlib.md5(data).hexdigest()) != md5.lower():
        raise bad_request(f"md5: the parts' MD5 is {digest}, not {md5}", "md5")
    return data


def _file_id(upload_id: str) -> str:
    return "file-" + upload_id.removeprefix("upload-")


def _complete(store: Store, tenant: str, upload: dict, body: CompleteRequest) -> dict:
    data = _joined(store, upload, body.part_ids, body.md5)
    try:
        VALIDATORS.get(upload["purpose"], validate_training_jsonl)(data)
    except ValueError as e:
        raise bad_request(f"part_ids: the uploaded file is not valid: {e}", "part_ids", "invalid_file") from e
    file = store.add_file(tenant, upload["filename"], upload["purpose"], data, file_id=_file_id(upload["id"]))
    done = store.update_upload(upload["id"], "pending", status="completed", file=file)
    if done is None:  # cancelled (or completed) meanwhile
        now = store.get_upload(None, upload["id"])
        if now["status"] == "completed":
            return now
        store.delete_file(tenant, file["id"])
        raise _not_pending(now)
    return done


@router.post("/v1/uploads/{upload_id}/complete")
async def complete_upload(upload_id: str, body: CompleteRequest, request: Request,
                          ctx: ServerContext = Depends(context)):
    upload = _own_upload(ctx, request, upload_id)
    if upload["status"] != "pending":
        raise _not_pending(upload)
    return await asyncio.to_thread(_complete, ctx.store, tenant_of(request), upload, body)


@router.post("/v1/uploads/{upload_id}/cancel")
async def cancel_upload(upload_id: str, request: Request, ctx: ServerContext = Depends(context)):
    _own_upload(ctx, request, upload_id)
    cancelled = await asyncio.to_thread(ctx.store.update_upload, upload_id, "pending", status="cancelled")
    if cancelled is None:
        raise _not_pending(ctx.store.get_upload(None, upload_id))
    return cancelled
