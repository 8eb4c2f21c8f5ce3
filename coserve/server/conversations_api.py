"""OpenAI's Conversations API: a conversation is a list of items (messages, calls and their results, reasoning) kept
in the server's SQLite state for its tenant alone, which ``POST /v1/responses`` with ``conversation`` continues,
adding the response's input and output to it.

``POST /v1/conversations`` (``items``: up to 20, ``metadata``), ``GET``, ``POST`` (new metadata) and ``DELETE
/v1/conversations/{id}``; ``POST /v1/conversations/{id}/items`` adds up to 20 items, ``GET .../items`` lists them
(``after``, ``limit`` 1-100, ``order`` ``desc`` by default; a page read from SQLite alone), ``GET`` and ``DELETE
.../items/{item_id}`` read and remove one. The reads take ``include`` as the Responses API does: a reply's token
logprobs are returned where it names ``message.output_text.logprobs``. Another tenant's conversation is a 404.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import Field

from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.conversation_items import MAX_ITEMS, kept_items, parse_items, shown
from coserve.server.errors import bad_request, not_found
from coserve.server.json_text import TextJSONRoute
from coserve.server.paging import check_limit
from coserve.server.protocol import Body, Metadata, list_page
from coserve.server.responses_api import INCLUDABLE

router = APIRouter(route_class=TextJSONRoute)


class NewConversation(Body):
    items: list[Any] | None = None
    metadata: Metadata = None


class ConversationUpdate(Body):
    metadata: Metadata = Field(...)


class NewItems(Body):
    items: list[Any]


def _items(given: list[Any], taken: set[str]) -> list[dict]:
    if len(given) > MAX_ITEMS:
        raise bad_request(f"items: at most {MAX_ITEMS} items at a time, got {len(given)}", "items")
    return kept_items(parse_items(given), taken)


def _item_ids(ctx: ServerContext, tenant: str, conversation_id: str) -> set[str]:
    ids = ctx.store.conversation_item_ids(tenant, conversation_id)
    if ids is None:
        raise not_found("conversation", conversation_id)
    return ids


def _logprobs(request: Request) -> bool:
    """Whether the query's ``include`` (``include=a&include=b``, or ``include[]=``) asks for a reply's token
    logprobs; a 400 naming a value the Responses API does not know."""
    given = request.query_params.getlist("include") + request.query_params.getlist("include[]")
    for i, name in enumerate(given):
        if name not in INCLUDABLE:
            raise bad_request(f"include[{i}]: {name!r} is not one of {', '.join(INCLUDABLE)}", f"include[{i}]")
    return "message.output_text.logprobs" in given


@router.post("/v1/conversations")
async def create_conversation(body: NewConversation, request: Request, ctx: ServerContext = Depends(context)):
    items = _items(body.items or [], set())
    obj = {"id": f"conv_{secrets.token_hex(24)}", "object": "conversation", "created_at": int(time.time()),
           "metadata": body.metadata or {}}
    await asyncio.to_thread(ctx.store.add_conversation, tenant_of(request), obj, items)
    return obj


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, request: Request, ctx: ServerContext = Depends(context)):
    obj = ctx.store.get_conversation(tenant_of(request), conversation_id)
    if obj is None:
        raise not_found("conversation", conversation_id)
    return obj


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(conversation_id: str, body: ConversationUpdate, request: Request,
                              ctx: ServerContext = Depends(context)):
    obj = ctx.store.update_conversation(tenant_of(request), conversation_id, body.metadata or {})
    if obj is None:
        raise not_found("conversation", conversation_id)
    return obj


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request, ctx: ServerContext = Depends(context)):
    if not ctx.store.delete_conversation(tenant_of(request), conversation_id):
        raise not_found("conversation", conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, body: NewItems, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    logprobs = _logprobs(request)
    items = _items(body.items, _item_ids(ctx, tenant, conversation_id))
    if not items:
        raise bad_request("items: is empty", "items")
    if not await asyncio.to_thread(ctx.store.add_conversation_items, tenant, conversation_id, items):
        raise not_found("conversation", conversation_id)  # deleted meanwhile
    return list_page([shown(i, logprobs) for i in items], False)


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(conversation_id: str, request: Request, after: str | None = None, limit: int = Query(20),
                     order: str = Query("desc"), ctx: ServerContext = Depends(context)):
    check_limit(limit, 100)
    if order not in ("asc", "desc"):
        raise bad_request(f"order: must be 'asc' or 'desc', got {order!r}", "order")
    logprobs = _logprobs(request)
    try:
        page = await asyncio.to_thread(ctx.store.conversation_items_page, tenant_of(request), conversation_id, after,
                                       limit, order == "desc")
    except KeyError:
        raise bad_request(f"after: {after!r} is not an item of conversation {conversation_id}", "after") from None
    if page is None:
        raise not_found("conversation", conversation_id)
    items, more = page
    return list_page([shown(i, logprobs) for i in items], more)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, request: Request, ctx: ServerContext = Depends(context)):
    tenant, logprobs = tenant_of(request), _logprobs(request)
    found = ctx.store.conversation_item(tenant, conversation_id, item_id)
    if found is None:
        if ctx.store.get_conversation(tenant, conversation_id) is None:
            raise not_found("conversation", conversation_id)
        raise not_found("item", item_id)
    return shown(found, logprobs)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    obj = ctx.store.get_conversation(tenant, conversation_id)
    if obj is None:
        raise not_found("conversation", conversation_id)
    if not ctx.store.delete_conversation_item(tenant, conversation_id, item_id):
        raise not_found("item", item_id)
    return obj
