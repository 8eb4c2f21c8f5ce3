"""OpenAI's ``POST /v1/embeddings`` (with vLLM's extensions): each input's embedding, the last token's final hidden
state (``PoolingParams``), computed in the engine's iterations beside generation and finetuning."""

from __future__ import annotations

import base64
import secrets
import struct

from fastapi import APIRouter, Depends, Request

from coserve.scheduler import PoolingParams
from coserve.server.choices import gather_all, new_job
from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.errors import APIError, bad_request
from coserve.server.inference_api import (completion_prompts, make_request, messages_chars, off_loop_if_long,
                                          prompt_chars, render_chat, submit, truncate)
from coserve.server.json_text import TextJSONRoute
from coserve.server.protocol import EmbeddingRequest

router = APIRouter(route_class=TextJSONRoute)
MAX_INPUTS = 2048  # OpenAI's limit on inputs in one request


def encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: a list of floats, or for ``base64`` its little-endian float32 bytes in
    base64 (what the ``openai`` client asks for by default, and decodes)."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")


def num_inputs(body: EmbeddingRequest) -> int:
    """How many embeddings ``body`` asks for: one per string or token-id list in ``input``, one for ``messages``."""
    given = [f for f in ("input", "messages") if getattr(body, f) is not None]
    if len(given) != 1:
        raise bad_request("input: give either input or messages" if given else "input: is required", "input")
    if body.messages is not None:
        return 1
    if body.input == "":  # OpenAI refuses an empty string (its tokens would be the special ones alone)
        raise bad_request("input: is empty", "input")
    if isinstance(body.input, list) and "" in body.input:
        raise bad_request(f"input[{body.input.index('')}]: is empty", "input")
    return 1 if isinstance(body.input, str) or (body.input and isinstance(body.input[0], int)) else len(body.input)


def check_dimensions(ctx: ServerContext, body: EmbeddingRequest) -> None:
    hidden = ctx.engine.model_config.hidden_size
    if body.dimensions is not None and body.dimensions > hidden:
        raise bad_request(f"dimensions: {body.dimensions} is more than this model's {hidden}", "dimensions")


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    adapter = await ctx.models.resolve(tenant, body.model)
    check_dimensions(ctx, body)
    count = num_inputs(body)
    if count > min(MAX_INPUTS, ctx.client.max_waiting_requests):
        raise APIError(400, f"input: {count} inputs in one request; this server takes at most "
                       f"{min(MAX_INPUTS, ctx.client.max_waiting_requests)}", "input", "too_many_inputs")
    ctx.client.check_capacity(count)  # before tokenizing them all
    if body.messages is not None:
        prompts = [await off_loop_if_long(messages_chars(body.messages), render_chat, ctx, body)]
        param = "messages"
    else:
        prompts = [ids for ids, _ in await off_loop_if_long(prompt_chars(body.input), completion_prompts, ctx,
                                                            body.input, "input")]
        param = "input"
    if body.truncate_prompt_tokens is not None:
        prompts = [truncate(ctx, body, ids) for ids in prompts]
    limit = ctx.engine.max_model_len
    for i, ids in enumerate(prompts):
        if len(ids) > limit:
            raise APIError(400, f"{param}[{i}]: {len(ids)} tokens; this model's maximum context length is {limit} "
                           f"tokens", param, "context_length_exceeded")
    params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    requests = [make_request(ctx, tenant, ids, params, adapter, param, body.priority) for ids in prompts]
    job = new_job(request, f"embd-{secrets.token_hex(12)}", body.model)
    submit(ctx, job, [(r, "") for r in requests], streamed=False)
    await gather_all(job, ctx, request)
    tokens = sum(len(c.prompt_ids) for c in job.choices)
    return {"id": job.ident, "object": "list", "created": job.created, "model": body.model,
            "data": [{"object": "embedding", "index": c.index, "embedding": encoded(c.out.embedding,
                                                                                     body.encoding_format)}
                     for c in job.choices],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
