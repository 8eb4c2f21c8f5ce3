"""OpenAI's Evals API: ``/v1/evals`` (an eval: testing criteria, which are graders, over items of a schema) and its
runs (``/v1/evals/{id}/runs``: items and their samples, given or sampled from a model the server serves, graded;
``eval_runs.py`` runs them) with their output items. A tenant sees only its own evals (anything else is a 404)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import Field

from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.errors import APIError, bad_request, found
from coserve.server.eval_data import check_criteria, check_data_source_config, check_run_source, item_schema
from coserve.server.eval_runs import FINISHED, new_run
from coserve.server.json_text import TextJSONRoute
from coserve.server.protocol import Body, Metadata, list_page

router = APIRouter(route_class=TextJSONRoute)
MAX_PAGE = 100


class EvalRequest(Body):
    name: str | None = None
    metadata: Metadata = Field(None, max_length=16)
    data_source_config: Any = None
    testing_criteria: Any = None


class EvalUpdate(Body):
    name: str | None = None
    metadata: Metadata = Field(None, max_length=16)


class RunRequest(Body):
    name: str | None = None
    metadata: Metadata = Field(None, max_length=16)
    data_source: Any = None


def _limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit: must be between 1 and {MAX_PAGE}, got {limit}", "limit")


def _eval(ctx: ServerContext, request: Request, eval_id: str) -> dict:
    return found(ctx.store.get_eval(tenant_of(request), eval_id), "eval", eval_id, "eval_id")


def _run(ctx: ServerContext, request: Request, eval_id: str, run_id: str) -> dict:
    _eval(ctx, request, eval_id)
    return found(ctx.store.get_eval_run(tenant_of(request), eval_id, run_id), "eval run", run_id, "run_id")


@router.post("/v1/evals")
async def create_eval(body: EvalRequest, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    config = check_data_source_config(body.data_source_config)
    criteria = check_criteria(body.testing_criteria, ctx.config.python_graders,
                              lambda model: ctx.models.servable(tenant, model))
    ev = {"id": f"eval_{secrets.token_hex(12)}", "object": "eval", "created_at": int(time.time()),
          "name": body.name or "eval", "metadata": body.metadata, "data_source_config": config,
          "testing_criteria": criteria}
    return await asyncio.to_thread(ctx.store.add_eval, tenant, ev)


@router.get("/v1/evals")
async def list_evals(request: Request, after: str | None = None, limit: int = Query(20),
                     order: Literal["asc", "desc"] = "asc", ctx: ServerContext = Depends(context)):
    _limit(limit)
    try:
        return list_page(*ctx.store.list_evals(tenant_of(request), after, limit, order == "asc"))
    except ValueError as e:
        raise bad_request(str(e), "after") from e


@router.get("/v1/evals/{eval_id}")
async def get_eval(eval_id: str, request: Request, ctx: ServerContext = Depends(context)):
    return _eval(ctx, request, eval_id)


@router.post("/v1/evals/{eval_id}")
async def update_eval(eval_id: str, body: EvalUpdate, request: Request, ctx: ServerContext = Depends(context)):
    _eval(ctx, request, eval_id)
    fields = {k: getattr(body, k) for k in ("name", "metadata") if k in body.model_fields_set}
    return ctx.store.update_eval(eval_id, **fields)


@router.delete("/v1/evals/{eval_id}")
async def delete_eval(eval_id: str, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    _eval(ctx, request, eval_id)
    page, more = ctx.store.list_eval_runs(tenant, eval_id, limit=MAX_PAGE)
    while True:
        for run in page:
            await ctx.evals.remove(run["id"])
        if not more:
            break
        page, more = ctx.store.list_eval_runs(tenant, eval_id, page[-1]["id"], MAX_PAGE)
    await asyncio.to_thread(ctx.store.delete_eval, tenant, eval_id)
    return {"object": "eval.deleted", "deleted": True, "eval_id": eval_id}


@router.post("/v1/evals/{eval_id}/runs")
async def create_run(eval_id: str, body: RunRequest, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    ev = _eval(ctx, request, eval_id)
    source = await asyncio.to_thread(check_run_source, body.data_source, ctx.store, tenant,
                                     lambda model: ctx.models.servable(tenant, model), item_schema(ev))
    run = await asyncio.to_thread(ctx.store.add_eval_run, tenant,
                                  new_run(eval_id, body.name, source, body.data_source, body.metadata))
    ctx.evals.submit(tenant, run, source)
    return run


@router.get("/v1/evals/{eval_id}/runs")
async def list_runs(eval_id: str, request: Request, after: str | None = None, limit: int = Query(20),
                    order: Literal["asc", "desc"] = "asc", status: str | None = None,
                    ctx: ServerContext = Depends(context)):
    _eval(ctx, request, eval_id)
    _limit(limit)
    try:
        return list_page(*ctx.store.list_eval_runs(tenant_of(request), eval_id, after, limit, order == "asc", status))
    except ValueError as e:
        raise bad_request(str(e), "after") from e


@router.get("/v1/evals/{eval_id}/runs/{run_id}")
async def get_run(eval_id: str, run_id: str, request: Request, ctx: ServerContext = Depends(context)):
    return _run(ctx, request, eval_id, run_id)


@router.post("/v1/evals/{eval_id}/runs/{run_id}/cancel")
async def cancel_run(eval_id: str, run_id: str, request: Request, ctx: ServerContext = Depends(context)):
    run = _run(ctx, request, eval_id, run_id)
    if run["status"] in FINISHED:
        raise APIError(409, f"The run is already {run['status']} and cannot be cancelled", "run_id",
                       "run_not_cancellable")
    return ctx.evals.cancel(run_id)


@router.delete("/v1/evals/{eval_id}/runs/{run_id}")
async def delete_run(eval_id: str, run_id: str, request: Request, ctx: ServerContext = Depends(context)):
    _run(ctx, request, eval_id, run_id)
    await ctx.evals.remove(run_id)
    await asyncio.to_thread(ctx.store.delete_eval_run, tenant_of(request), eval_id, run_id)
    return {"object": "eval.run.deleted", "deleted": True, "run_id": run_id}


@router.get("/v1/evals/{eval_id}/runs/{run_id}/output_items")
async def list_output_items(eval_id: str, run_id: str, request: Request, after: str | None = None,
                            limit: int = Query(20), order: Literal["asc", "desc"] = "asc",
                            status: Literal["pass", "fail", "error"] | None = None,
                            ctx: ServerContext = Depends(context)):
    _run(ctx, request, eval_id, run_id)
    _limit(limit)
    try:
        return list_page(*ctx.store.list_eval_items(run_id, after, limit, order == "asc", status))
    except ValueError as e:
        raise bad_request(str(e), "after") from e


@router.get("/v1/evals/{eval_id}/runs/{run_id}/output_items/{item_id}")
async def get_output_item(eval_id: str, run_id: str, item_id: str, request: Request,
                          ctx: ServerContext = Depends(context)):
    _run(ctx, request, eval_id, run_id)
    return found(ctx.store.get_eval_item(run_id, item_id), "output item", item_id, "output_item_id")
