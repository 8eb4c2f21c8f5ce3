"""OpenAI's ``POST /v1/embeddings`` (with vLLM's extensions): each input's embedding, the last token's final hidden
state (``PoolingParams``), computed in the engine's iterations beside generation and finetuning."""

from __future__ import annotations

import base64
import secrets
import struct

from fastapi import APIRouter, Depends, Request

from coserve.scheduler import PoolingParams
from coserve.server.choices import Job, gather_all, new_job
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


async def tokenized(ctx: ServerContext, texts, param: str, truncate_body) -> list[list[int]]:
    """``texts`` (a string, strings, token ids or lists of them) as token-id lists, each cut to
    ``truncate_body.truncate_prompt_tokens`` where that is set; 400 naming ``param`` for an empty one or one longer
    than the context (an embedding needs no room to generate: the whole context may be used)."""
    prompts = [ids for ids, _ in await off_loop_if_long(prompt_chars(texts), completion_prompts, ctx, texts, param,
                                                        False)]
    if truncate_body.truncate_prompt_tokens is not None:
        prompts = [truncate(ctx, truncate_body, ids) for ids in prompts]
    check_lengths(ctx, prompts, param)
    return prompts


def check_lengths(ctx: ServerContext, prompts: list[list[int]], param: str) -> None:
    limit = ctx.engine.max_model_len
    for i, ids in enumerate(prompts):
        if len(ids) > limit:
            raise APIError(400, f"{param}[{i}]: {len(ids)} tokens; this model's maximum context length is {limit} "
                           f"tokens", param, "context_length_exceeded")


def check_count(ctx: ServerContext, count: int, param: str) -> None:
    """At most ``MAX_INPUTS`` (and what the server queues) in one request (400 naming ``param``), and room in the
    queue now (503)."""
    limit = min(MAX_INPUTS, ctx.client.max_waiting_requests)
    if count > limit:
        raise APIError(400, f"{param}: {count} inputs in one request; this server takes at most {limit}", param,
                       "too_many_inputs")
    ctx.client.check_capacity(count)


async def embed_all(ctx: ServerContext, request: Request, job: Job, tenant: str, adapter: str | None,
                    prompts: list[list[int]], params: PoolingParams, param: str, priority: int) -> list[list[float]]:
    """Every prompt's embedding, computed in the engine as ``job``'s choices (in order)."""
    requests = [make_request(ctx, tenant, ids, params, adapter, param, priority) for ids in prompts]
    submit(ctx, job, [(r, "") for r in requests], streamed=False)
    await gather_all(job, ctx, request)
    return [c.out.embedding for c in job.choices]


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    adapter = await ctx.models.resolve(tenant, body.model)
    check_dimensions(ctx, body)
    check_count(ctx, num_inputs(body), "input")  # before tokenizing them all
    if body.messages is not None:
        param = "messages"
        prompts = [await off_loop_if_long(messages_chars(body.messages), render_chat, ctx, body)]
        if body.truncate_prompt_tokens is not None:
            prompts = [truncate(ctx, body, prompts[0])]
        check_lengths(ctx, prompts, param)
    else:
        param = "input"
        prompts = await tokenized(ctx, body.input, param, body)
    job = new_job(request, f"embd-{secrets.token_hex(12)}", body.model)
    vectors = await embed_all(ctx, request, job, tenant, adapter, prompts,
                              PoolingParams(dimensions=body.dimensions, normalize=body.normalize), param, body.priority)
    tokens = sum(len(ids) for ids in prompts)
    return {"id": job.ident, "object": "list", "created": job.created, "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
