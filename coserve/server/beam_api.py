"""vLLM's ``use_beam_search`` on ``/v1/completions``: the engine's beam search (``coserve/engine/beam_search.py``)
driven through the engine client, one round of one-token requests at a time; ``n`` is the beam width and the
number of completions per prompt. Not streamed (as vLLM); each round's requests are aborted if the route fails."""

from __future__ import annotations

import asyncio
import secrets
import time

from coserve.engine.beam_search import BeamSearchParams, BeamState
from coserve.engine.outputs import RequestOutput
from coserve.server.context import ServerContext
from coserve.server.errors import bad_request
from coserve.server.generation import RequestStream


async def completions_by_beam_search(ctx: ServerContext, tenant: str, body, adapter: str | None,
                                     prompts: list[tuple[list[int], str]], max_tokens: int, make_request) -> dict:
    """The completions response of a beam search over ``prompts`` (token ids, text)."""
    for field, bad in (("stream", body.stream), ("logprobs", body.logprobs is not None), ("echo", body.echo)):
        if bad:
            raise bad_request(f"{field}: not available with use_beam_search", field)
    params = BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                              length_penalty=body.length_penalty)
    state = BeamState([ids for ids, _ in prompts], params, frozenset(ctx.engine.eos_token_ids))
    while batch := state.pending():
        ctx.client.check_capacity(len(batch))
        streams = [ctx.client.submit(make_request(ctx, tenant, ids, state.step_params, adapter, "prompt"))
                   for ids in batch]
        try:
            outs = await asyncio.gather(*(_last(s) for s in streams))
        finally:
            for s in streams:
                await s.aclose()
        state.advance([out.outputs[0].logprobs[0].top for out in outs])
    results = state.results(lambda ids: ctx.engine.tokenizer.decode(ids, skip_special_tokens=True))
    choices, completion = [], 0
    for p, (result, (ids, _)) in enumerate(zip(results, prompts)):
        for j, seq in enumerate(result.sequences):
            n_out = len(seq.tokens) - len(ids)
            completion += n_out
            choices.append({"index": p * body.n + j, "text": seq.text, "logprobs": None,
                            "finish_reason": "stop" if seq.finished else "length", "stop_reason": None})
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": body.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}


async def _last(stream: RequestStream) -> RequestOutput:
    out = None
    async for out in stream:
        pass
    return out
