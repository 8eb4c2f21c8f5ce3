"""OpenAI's checkpoint permissions: a tenant shares one of its fine-tuned models or checkpoints with other tenants
(OpenAI's projects), which may then use it as their own for inference and as the start of their own fine-tuning
jobs, and find it in their ``/v1/models`` (``owned_by`` its owner). Only the owner grants, lists and revokes, and
only the owner deletes the model; a deleted model is served to no one. Tenants are the keys file's."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Query, Request

from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.errors import bad_request, not_found
from coserve.server.json_text import TextJSONRoute
from coserve.server.paging import check_limit, page_after
from coserve.server.protocol import PermissionRequest, list_page

router = APIRouter(route_class=TextJSONRoute)
PREFIX = "/v1/fine_tuning/checkpoints/{model}/permissions"


def _owned(ctx: ServerContext, request: Request, model: str) -> str:
    """The caller's tenant, which must own ``model`` (404 otherwise, as for a model it cannot see)."""
    tenant = tenant_of(request)
    if ctx.models.owned_path(tenant, model) is None:
        raise not_found("model", model, "fine_tuned_model_checkpoint")
    return tenant


@router.post(PREFIX)
async def share(model: str, body: PermissionRequest, request: Request, ctx: ServerContext = Depends(context)):
    """Grant each of ``project_ids`` (tenants of this server) the use of ``model``; the permissions, in order (one
    granted before is given again, unchanged)."""
    tenant = _owned(ctx, request, model)
    known = set(ctx.auth.keys.values())
    if not body.project_ids:
        raise bad_request("project_ids: give at least one tenant to share the model with", "project_ids")
    for i, project in enumerate(body.project_ids):
        if project == tenant:
            raise bad_request(f"project_ids[{i}]: {project!r} owns the model", f"project_ids[{i}]")
        if project not in known:
            raise bad_request(f"project_ids[{i}]: {project!r} is not a tenant of this server", f"project_ids[{i}]")
    made = [await asyncio.to_thread(ctx.store.share_model, tenant, model, p) for p in dict.fromkeys(body.project_ids)]
    return list_page(made, False)


@router.get(PREFIX)
async def list_permissions(model: str, request: Request, after: str | None = None, limit: int = Query(10),
                           order: str = Query("descending"), project_id: str | None = None,
                           ctx: ServerContext = Depends(context)):
    """The model's permissions, newest first (``order=descending``) or oldest first, ``limit`` (1-100) after the
    permission ``after``, those of ``project_id`` alone where given."""
    _owned(ctx, request, model)
    check_limit(limit, 100)
    if order not in ("ascending", "descending"):
        raise bad_request(f"order: must be 'ascending' or 'descending', got {order!r}", "order")
    found = [p for p in ctx.store.model_permissions(model) if project_id is None or p["project_id"] == project_id]
    if order == "descending":
        found.reverse()
    return list_page(*page_after(found, after, limit, f"a permission of {model}"))


@router.delete(PREFIX + "/{permission_id}")
async def unshare(model: str, permission_id: str, request: Request, ctx: ServerContext = Depends(context)):
    """Revoke a permission: its tenant's next requests naming the model are 404s (those running finish)."""
    _owned(ctx, request, model)
    if not await asyncio.to_thread(ctx.store.unshare_model, model, permission_id):
        raise not_found("permission", permission_id, "permission_id")
    return {"id": permission_id, "object": "checkpoint.permission", "deleted": True}
