"""vLLM's ``POST /score`` and ``POST /rerank`` over embeddings: a pair's score is the cosine similarity of the two
texts' embeddings (``embeddings_api``), as vLLM scores with an embedding model."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Depends, Request

from coserve.scheduler import PoolingParams
from coserve.server.choices import new_job
from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.embeddings_api import check_count, embed_all, tokenized
from coserve.server.errors import bad_request
from coserve.server.json_text import TextJSONRoute
from coserve.server.protocol import RerankRequest, ScoreRequest

router = APIRouter(route_class=TextJSONRoute)


def cosine(a: list[float], b: list[float]) -> float:
    """Of two unit vectors: their dot product."""
    return sum(x * y for x, y in zip(a, b))


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> tuple[list[str], list[str]]:
    """vLLM's pairing: one ``text_1`` with every ``text_2``, or the two lists pairwise (400 when their lengths
    differ, or one is empty)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise bad_request(f"{name}: is empty", name)
        if "" in texts:
            raise bad_request(f"{name}[{texts.index('')}]: is empty", name)
    if len(first) != 1 and len(first) != len(second):
        raise bad_request(f"text_1: {len(first)} texts for {len(second)} in text_2 (give one, or as many)", "text_1")
    return first, second


async def similarities(ctx: ServerContext, request: Request, body, ident: str, queries: list[str], texts: list[str],
                       params: tuple[str, str]) -> tuple[object, list[float], int]:
    """The scores of ``queries`` (one, or one per text) against ``texts``: the job, the scores and the tokens
    embedded (a single query once, however many texts)."""
    tenant = tenant_of(request)
    adapter = await ctx.models.resolve(tenant, body.model)
    check_count(ctx, len(queries) + len(texts), params[1])
    prompts = await tokenized(ctx, queries, params[0], body) + await tokenized(ctx, texts, params[1], body)
    job = new_job(request, ident, body.model)
    vectors = await embed_all(ctx, request, job, tenant, adapter, prompts, PoolingParams(), params[1], body.priority)
    firsts, seconds = vectors[:len(queries)], vectors[len(queries):]
    scores = [cosine(firsts[0 if len(firsts) == 1 else i], v) for i, v in enumerate(seconds)]
    return job, scores, sum(len(ids) for ids in prompts)


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request, ctx: ServerContext = Depends(context)):
    first, second = score_pairs(body.text_1, body.text_2)
    job, scores, tokens = await similarities(ctx, request, body, f"score-{secrets.token_hex(12)}", first, second,
                                             ("text_1", "text_2"))
    return {"id": job.ident, "object": "list", "created": job.created, "model": body.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request, ctx: ServerContext = Depends(context)):
    if not body.query:
        raise bad_request("query: is empty", "query")
    if "" in body.documents:
        raise bad_request(f"documents[{body.documents.index('')}]: is empty", "documents")
    job, scores, tokens = await similarities(ctx, request, body, f"rerank-{secrets.token_hex(12)}", [body.query],
                                             body.documents, ("query", "documents"))
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:body.top_n or None]
    return {"id": job.ident, "model": body.model, "usage": {"total_tokens": tokens},
            "results": [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]}
                        for i in ranked]}
