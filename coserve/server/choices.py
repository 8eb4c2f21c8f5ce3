"""A request's choices, already in the engine, run to their end: streamed as server-sent events as tokens
arrive, or gathered whole; either way a client that leaves aborts them, and each choice's outcome is counted."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from coserve.engine.outputs import RequestOutput
from coserve.scheduler.sampling_params import ReasoningTokens
from coserve.server.context import ServerContext
from coserve.server.errors import APIError
from coserve.server.generation import RequestStream, TextDelta
from coserve.server.protocol import StreamOptions


@dataclass(slots=True)
class Choice:
    """One generated sequence of a request and what has been sent of it."""

    index: int
    prompt_ids: list[int]
    stream: RequestStream
    delta: TextDelta
    prefix: str = ""  # echo: the prompt's text
    prefix_sent: bool = False  # a stream has sent it
    text_offset_base: int | None = None  # where the completion's logprobs text offsets start (echo: after the prompt)
    out: RequestOutput | None = None
    logprobs_sent: int = 0
    first_token_at: float | None = None
    first_text_at: float | None = None  # a stream's first event of this choice's output (text held back until then)
    finished_at: float | None = None

    def sent_text(self) -> None:
        """Notes a stream's event of this choice's output going out: the first one is the access log's
        ``first_text_ms``."""
        if self.first_text_at is None:
            self.first_text_at = time.monotonic()


@dataclass(slots=True)
class Job:
    """A request's choices, ready to run."""

    ident: str
    created: int
    model: str
    n: int = 1  # choices per prompt
    choices: list[Choice] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)  # when the server received it (time.monotonic)
    counted: bool = False  # its choices' outcomes are in the metrics
    reasoning: ReasoningTokens | None = None  # a reasoning parser's tags (--reasoning-parser): usage counts them

    def log_fields(self) -> dict:
        """What the access log adds for this request: its id, model and tokens, and where its first token's time
        went: ``ttft_ms`` from arrival to the first token on the event loop, ``engine_ttft_ms`` the part from
        its submission to the engine (the rest is the HTTP layer, parsing, the chat template and tokenizing), and for
        a stream ``first_text_ms`` from arrival to the first event carrying output (later than the first token where
        its text was held back: an unfinished UTF-8 character, or what may begin a stop string)."""
        fields = {"id": self.ident, "model": self.model}
        started = [c for c in self.choices if c.first_token_at is not None]
        if started:
            first = min(started, key=lambda c: c.first_token_at)
            fields["ttft_ms"] = round((first.first_token_at - self.arrived) * 1000, 3)
            fields["engine_ttft_ms"] = round((first.first_token_at - first.stream.submitted_at) * 1000, 3)
        texts = [c.first_text_at for c in self.choices if c.first_text_at is not None]
        if texts:
            fields["first_text_ms"] = round((min(texts) - self.arrived) * 1000, 3)
        if self.choices:
            counts = usage(self)
            fields["prompt_tokens"], fields["completion_tokens"] = counts["prompt_tokens"], counts["completion_tokens"]
        return fields


def new_job(request: Request, ident: str, model: str, n: int = 1) -> Job:
    """A route's Job, arrived when the server received the request (``ServerMiddleware`` notes the time), and
    known to the access log line the middleware writes when the response ends."""
    job = Job(ident, int(time.time()), model, n, arrived=getattr(request.state, "arrived", None) or time.monotonic())
    request.state.job = job
    return job


async def advance(choice: Choice, job: Job, ctx: ServerContext) -> RequestOutput:
    out = await anext(choice.stream)
    choice.out = out
    now = time.monotonic()
    if choice.first_token_at is None and out.outputs[0].token_ids:
        choice.first_token_at = now
        ctx.metrics.ttft.observe(now - job.arrived)
    if out.finished:
        choice.finished_at = now
        n = len(out.outputs[0].token_ids)
        if n > 1 and choice.first_token_at is not None:
            ctx.metrics.tpot.observe((now - choice.first_token_at) / (n - 1))
    return out


async def run_to_end(choice: Choice, job: Job, ctx: ServerContext) -> None:
    while choice.out is None or not choice.out.finished:
        await advance(choice, job, ctx)


def usage(job: Job) -> dict:
    prompt = sum(len(c.prompt_ids) for c in job.choices if c.index % job.n == 0)  # each prompt once
    completion = sum(len(c.out.outputs[0].token_ids) for c in job.choices if c.out is not None)
    cached = sum(c.out.num_cached_tokens for c in job.choices if c.index % job.n == 0 and c.out is not None)
    counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
              "prompt_tokens_details": {"cached_tokens": cached}}
    if job.reasoning is not None:  # OpenAI's: the completion's tokens of reasoning, its tags included
        counts["completion_tokens_details"] = {"reasoning_tokens": sum(
            job.reasoning.count(c.out.outputs[0].token_ids) for c in job.choices if c.out is not None)}
    return counts


def mean_logprob(out: RequestOutput) -> float:
    """A completion's log probability per token (-inf without a token): OpenAI's ``best_of`` ranks by it."""
    logprobs = out.outputs[0].logprobs or []
    return sum(t.logprob for t in logprobs) / len(logprobs) if logprobs else -math.inf


def best_choices(choices: list[Choice], best_of: int, n: int) -> list[Choice]:
    """Of each prompt's ``best_of`` finished candidates (consecutive in ``choices``), the ``n`` with the highest log
    probability per token, best first (the earlier candidate on a tie)."""
    kept = []
    for start in range(0, len(choices), best_of):
        group = choices[start:start + best_of]
        kept += sorted(group, key=lambda c: (-mean_logprob(c.out), c.index))[:n]
    return kept


def finish_reason(out: RequestOutput) -> str | None:
    reason = out.outputs[0].finish_reason
    return "stop" if reason == "abort" else reason


async def close_all(job: Job) -> None:
    """Abort every choice still running in the engine (idempotent)."""
    for c in job.choices:
        if c.out is None or not c.out.finished:
            await c.stream.aclose()


def count_outcomes(job: Job, ctx: ServerContext, unfinished: str) -> None:
    """Each choice's outcome into the metrics, once: ``ok`` if it finished, else ``unfinished``."""
    if job.counted:
        return
    job.counted = True
    done = sum(1 for c in job.choices if c.out is not None and c.out.finished)
    if done:
        ctx.metrics.request_done("ok", done)
    if len(job.choices) - done:
        ctx.metrics.request_done(unfinished, len(job.choices) - done)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


def choice_usage(choice: Choice) -> dict:
    """vLLM's ``continuous_usage_stats``: a choice's counts so far, on each of its stream's chunks."""
    completion = len(choice.out.outputs[0].token_ids) if choice.out is not None else 0
    return {"prompt_tokens": len(choice.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(choice.prompt_ids) + completion}


def stream_usage(options: StreamOptions | None) -> tuple[bool, bool]:
    """``(include_usage, continuous)`` of a request's ``stream_options``: the usage chunk before ``[DONE]``, and
    vLLM's usage on every chunk (which needs ``include_usage`` too, as vLLM's does)."""
    include = bool(options and options.include_usage)
    return include, include and options.continuous_usage_stats


async def events(job: Job, ctx: ServerContext, chunk, last_chunk, include_usage: bool,
                 continuous_usage: bool = False) -> AsyncIterator[str]:
    """Server-sent events for every choice's new text, interleaved as tokens arrive, then ``[DONE]``. Several
    choices are read by a task each into one queue; a single choice (the common case) is read directly, which
    spares each streamed token two task switches on the event loop. ``continuous_usage``: each chunk carries its
    choice's token counts so far."""
    def event(choice: Choice, body: dict) -> str:
        if continuous_usage:
            body["usage"] = choice_usage(choice)
        return sse(body)

    async def read(choice: Choice) -> tuple[Choice, RequestOutput | BaseException]:
        """The choice's next output, or the error that ended it."""
        try:
            return choice, await advance(choice, job, ctx)
        except Exception as e:
            return choice, e

    async def pump(choice: Choice) -> None:
        while True:
            item = await read(choice)
            await queue.put(item)
            if isinstance(item[1], BaseException) or item[1].finished:
                return

    queue: asyncio.Queue[tuple[Choice, RequestOutput | BaseException]] | None = None
    tasks = []
    if len(job.choices) > 1:
        queue = asyncio.Queue()
        tasks = [asyncio.create_task(pump(c)) for c in job.choices]

    async def next_output() -> tuple[Choice, RequestOutput | BaseException]:
        return await queue.get() if queue is not None else await read(job.choices[0])

    failed = False
    try:
        open_choices = len(job.choices)
        for c in job.choices:
            first = chunk(c, None)
            if first is not None:
                yield event(c, first)
        while open_choices:
            choice, out = await next_output()
            if isinstance(out, BaseException):
                error = out if isinstance(out, APIError) else APIError(500, f"generation failed ({out})")
                failed = True
                yield sse(error.body())
                break
            body = chunk(choice, out)
            if body is not None:
                choice.sent_text()
                yield event(choice, body)
            if out.finished:
                open_choices -= 1
                yield event(choice, last_chunk(choice, out))
        else:
            if include_usage:
                yield sse({"id": job.ident, "object": _object(job), "created": job.created, "model": job.model,
                           "choices": [], "usage": usage(job)})
            yield sse("[DONE]")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(job)
        count_outcomes(job, ctx, "error" if failed else "cancelled")


def _object(job: Job) -> str:
    return "chat.completion.chunk" if job.ident.startswith("chatcmpl") else "text_completion"


class EventStream(StreamingResponse):
    """Server-sent events of a job whose requests are already in the engine: however the response ends (even a
    client gone before the first event, when the generator never starts and so never runs its ``finally``),
    every unfinished choice is aborted, freeing its KV blocks."""

    def __init__(self, gen: AsyncIterator[str], job: Job, ctx: ServerContext) -> None:
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job, self.ctx = job, ctx

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_all(self.job)
            count_outcomes(self.job, self.ctx, "cancelled")


def streaming(gen: AsyncIterator[str], job: Job, ctx: ServerContext) -> StreamingResponse:
    return EventStream(gen, job, ctx)


async def disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body was read already, so ``receive`` waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # a server that answers at once with empty bodies must not spin us


async def gather_all(job: Job, ctx: ServerContext, request: Request) -> None:
    """Run every choice to its end; a client that goes away first aborts them all, as a closed stream does
    (a non-streamed response is not cancelled by the server when its client leaves)."""
    work = asyncio.ensure_future(asyncio.gather(*(run_to_end(c, job, ctx) for c in job.choices)))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise APIError(499, "The client closed the request", code="client_closed_request")
        work.result()
    except BaseException:
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        await close_all(job)
        count_outcomes(job, ctx, "cancelled" if gone.done() else "error")
        raise
    finally:
        gone.cancel()
    count_outcomes(job, ctx, "ok")
