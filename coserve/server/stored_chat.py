"""OpenAI's stored chat completions: a chat request with ``store: true`` keeps its ``chat.completion`` (with the
request's ``metadata``) and the messages it answered in the server's SQLite state, for its tenant alone: ``GET
/v1/chat/completions`` lists them (by ``model`` and ``metadata[k]=v``, oldest first unless ``order=desc``), ``GET``,
``POST`` (new metadata) and ``DELETE /v1/chat/completions/{id}`` read, relabel and forget one, and ``GET
.../{id}/messages`` lists the messages it answered. A streamed request is kept once its stream has ended whole; one
its client left is not."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Query, Request
from pydantic import Field

from coserve.server.choices import sse
from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.errors import bad_request, not_found
from coserve.server.json_text import TextJSONRoute
from coserve.server.paging import check_limit, metadata_filter, page_after
from coserve.server.protocol import Body, ChatCompletionRequest, Metadata, list_page

log = logging.getLogger("coserve.server")
router = APIRouter(route_class=TextJSONRoute)
MOST = 100  # the largest page
DONE = sse("[DONE]")


class MetadataUpdate(Body):
    """``POST /v1/chat/completions/{id}``: the stored completion's new metadata (null: none)."""

    metadata: Metadata = Field(...)


def store_chat(ctx: ServerContext, tenant: str, body: ChatCompletionRequest, reply: dict) -> None:
    """Keep ``reply`` (with the request's metadata) and the messages it answered."""
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    ctx.store.add_chat_completion(tenant, {**reply, "metadata": body.metadata or {}}, messages)


async def store_after(sent: AsyncIterator[str], ctx: ServerContext, tenant: str, body: ChatCompletionRequest,
                      whole: Callable[[], dict]) -> AsyncIterator[str]:
    """The stream's events, the completion they made (``whole()``) kept before the last, ``[DONE]``: a client that
    reads it finds the completion stored; a stream that does not reach it keeps none."""
    try:
        async for event in sent:
            if event == DONE:
                try:
                    await asyncio.to_thread(store_chat, ctx, tenant, body, whole())
                except Exception:  # the reply stands, whole and streamed; only its copy is lost, and said so
                    log.exception("storing a streamed chat completion failed")
            yield event
    finally:  # a client that left: the stream's own cleanup (its requests aborted) now, not when it is collected
        await sent.aclose()


def _order(order: str) -> bool:
    if order not in ("asc", "desc"):
        raise bad_request(f"order: must be 'asc' or 'desc', got {order!r}", "order")
    return order == "asc"


def _stored(ctx: ServerContext, request: Request, completion_id: str) -> tuple[dict, list[dict]]:
    found = ctx.store.get_chat_completion(tenant_of(request), completion_id)
    if found is None:
        raise not_found("chat completion", completion_id, "completion_id")
    return found


@router.get("/v1/chat/completions")
async def list_chat_completions(request: Request, model: str | None = None, after: str | None = None,
                                limit: int = Query(20), order: str = Query("asc"),
                                ctx: ServerContext = Depends(context)):
    check_limit(limit, MOST)
    ascending = _order(order)
    pairs, null = metadata_filter(request)
    if null:
        raise bad_request("metadata: filter stored completions by metadata[key]=value pairs", "metadata")
    try:
        page, more = await asyncio.to_thread(ctx.store.list_chat_completions, tenant_of(request), model, pairs,
                                             after, limit, ascending)
    except ValueError as e:  # an ``after`` that is no completion of this tenant's
        raise bad_request(str(e), str(e).split(":", 1)[0]) from None
    return list_page(page, more)


@router.get("/v1/chat/completions/{completion_id}")
async def get_chat_completion(completion_id: str, request: Request, ctx: ServerContext = Depends(context)):
    return _stored(ctx, request, completion_id)[0]


@router.get("/v1/chat/completions/{completion_id}/messages")
async def list_chat_messages(completion_id: str, request: Request, after: str | None = None,
                             limit: int = Query(20), order: str = Query("asc"),
                             ctx: ServerContext = Depends(context)):
    """The messages the completion answered, each with an id of the completion's and its place."""
    check_limit(limit, MOST)
    ascending = _order(order)
    _, messages = _stored(ctx, request, completion_id)
    items = [{"id": f"{completion_id}-{i}", **m} for i, m in enumerate(messages)]
    if not ascending:
        items.reverse()
    return list_page(*page_after(items, after, limit, f"a message of {completion_id}"))


@router.post("/v1/chat/completions/{completion_id}")
async def update_chat_completion(completion_id: str, body: MetadataUpdate, request: Request,
                                 ctx: ServerContext = Depends(context)):
    updated = await asyncio.to_thread(ctx.store.update_chat_completion, tenant_of(request), completion_id,
                                      body.metadata or {})
    if updated is None:
        raise not_found("chat completion", completion_id, "completion_id")
    return updated


@router.delete("/v1/chat/completions/{completion_id}")
async def delete_chat_completion(completion_id: str, request: Request, ctx: ServerContext = Depends(context)):
    if not await asyncio.to_thread(ctx.store.delete_chat_completion, tenant_of(request), completion_id):
        raise not_found("chat completion", completion_id, "completion_id")
    return {"object": "chat.completion.deleted", "id": completion_id, "deleted": True}
