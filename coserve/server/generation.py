"""Access to the engine thread: submit a request, receive its outputs as they come, abort on disconnect; run
anything else on the engine between two iterations (``on_engine_async``; ``EngineLoop.post_and_wait``
from a thread)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from coserve.engine.engine_loop import ALIVE_CHECK_S, EngineLoop
from coserve.engine.outputs import RequestOutput
from coserve.scheduler import Request
from coserve.server.errors import APIError

T = TypeVar("T")
UNSTREAMED = 2**62  # a response sent whole needs no output between its first token's and its last


async def on_engine_async(loop: EngineLoop, fn: Callable[[], T]) -> T:
    """``EngineLoop.post_and_wait`` for a coroutine: the event loop waits without blocking (nor taking a worker
    thread)."""
    future = asyncio.wrap_future(loop.post_future(fn))
    while True:
        done, _ = await asyncio.wait({future}, timeout=ALIVE_CHECK_S)
        if done:
            return future.result()
        loop.check_alive()


class EngineClient:
    """What the HTTP routes use of the engine; ``EngineLoop.post`` keeps the event loop from ever blocking
    on an iteration in flight."""

    def __init__(self, loop: EngineLoop, max_waiting_requests: int, stream_interval: int = 1) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.max_waiting_requests = max_waiting_requests
        self.stream_interval = stream_interval  # a stream hears of every this many new tokens (``RequestStream``)
        self.in_flight = 0  # requests submitted and not ended (counted on the event loop's thread only)

    def check_capacity(self, new_requests: int) -> None:
        """503 when ``new_requests`` more would queue over the limit (400 when they never could). Queued: the scheduler's waiting requests, or
        more where submissions have not reached the engine thread yet (a burst, within one iteration)."""
        if new_requests > self.max_waiting_requests:  # never fits, however long the client waits
            raise APIError(400, f"The request asks for {new_requests} generations at once; this server queues at most "
                           f"{self.max_waiting_requests} (lower n or send fewer prompts)", "n", "too_many_choices")
        scheduler = self.engine.scheduler
        waiting = max(len(scheduler.waiting), self.in_flight - len(scheduler.running))
        if waiting + new_requests > self.max_waiting_requests:
            raise APIError(503, f"The server is over capacity ({waiting} requests waiting); retry later",
                           code="server_overloaded")

    def submit(self, request: Request, text: str | None = None, streamed: bool = True) -> "RequestStream":
        """Hand ``request`` to the engine now (before any response is sent); iterate the result for its outputs:
        the first token's, then one every ``stream_interval`` tokens, and the last. ``streamed=False`` (a
        response sent whole): only the first token's (its time is measured) and the last."""
        return RequestStream(self, request, text, self.stream_interval if streamed else UNSTREAMED)


class RequestStream:
    """A submitted request's outputs as an async iterator; ``aclose`` aborts it unless it has finished.

    Outputs are cumulative (each holds all the text so far), so the ones between two that reach the event loop
    can be left out: with ``every`` > 1 it hears of the first token at once, then of every ``every`` new
    tokens, and of the end (vLLM's and SGLang's ``--stream-interval``). Each output that reaches it wakes the
    event loop from the engine thread and becomes a server-sent event; on a CPU whose cores also run the engine,
    fewer of them leave the engine more time (``coserve bench-server --stream-interval``)."""

    def __init__(self, client: EngineClient, request: Request, text: str | None, every: int = 1) -> None:
        self.client = client
        self.request_id = rid = request.request_id
        self.submitted_at = time.monotonic()  # handed to the engine (its part of the TTFT starts here)
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self._closed = False
        aio = asyncio.get_running_loop()
        loop = client.loop
        heard = 0  # tokens in the last output passed on (touched on the engine thread only)

        def listener(out: RequestOutput | BaseException) -> None:
            nonlocal heard
            if isinstance(out, RequestOutput) and not out.finished:
                tokens = len(out.outputs[0].token_ids)
                if heard and tokens - heard < every:
                    return  # a later output carries these tokens too
                heard = tokens
            aio.call_soon_threadsafe(self.queue.put_nowait, out)

        def submit() -> None:
            adapter = request.adapter
            if adapter is not None and adapter not in client.engine.adapters:
                # unloaded since the route resolved the model (an unload sees only queued requests as users):
                # queued, the request would stop the engine in the executor
                listener(APIError(404, f"The model '{adapter}' was unloaded", "model", "model_not_found"))
                return
            loop.listeners[rid] = listener
            try:
                client.engine.enqueue(request, text)
            except Exception as e:  # reported to the waiting route rather than lost
                loop.listeners.pop(rid, None)
                listener(e)

        loop.post(submit, arrival=True)
        client.in_flight += 1  # until it ends (_end) or is aborted (aclose)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        try:
            out = await self.queue.get()
        except BaseException:  # cancelled (the client went away): free the request's KV blocks
            await self.aclose()
            raise
        if isinstance(out, BaseException):
            self._end()
            raise out if isinstance(out, APIError) else APIError(
                503, f"the engine could not run the request ({out})", code="engine_error")
        if out.finished:
            self._end()
            if out.error is not None:  # the iteration running it failed; the engine serves on
                raise APIError(500, f"The engine failed while generating ({out.error})", code="engine_error")
        return out

    def _end(self) -> None:
        self.finished = True
        self.client.in_flight -= 1

    async def aclose(self) -> None:
        if self.finished or self._closed:
            return
        self._closed = True
        self.client.in_flight -= 1
        loop, engine, rid = self.client.loop, self.client.engine, self.request_id

        def abort() -> None:  # on the engine thread, after every output of the iterations before it was passed on
            if rid in loop.listeners:  # not finished yet: its final output (the abort's) is dropped, not kept for a
                loop.listeners[rid] = _drop  # ``wait_for`` no one will call (every closed stream leaked one)
            engine.abort_request(rid)
        loop.post(abort)


def _drop(out: RequestOutput | BaseException) -> None:
    """The listener of a request whose stream was closed: what it still produces goes nowhere."""


@dataclass(slots=True)
class TextDelta:
    """Streams a request's text as deltas, holding back what may still change: the last characters that could
    start a stop string (they are cut if it completes) and an unfinished UTF-8 character (decoded as U+FFFD)."""

    hold: int = 0  # longest stop string - 1
    sent: int = 0  # characters already sent

    @classmethod
    def for_stops(cls, stops: list[str]) -> "TextDelta":
        return cls(max((len(s) for s in stops), default=1) - 1)

    def next(self, text: str, finished: bool) -> str:
        upto = len(text) if finished else len(text) - self.hold
        if not finished:
            while upto > self.sent and text[upto - 1] == "\ufffd":
                upto -= 1
        if upto <= self.sent:
            return ""
        delta, self.sent = text[self.sent:upto], upto
        return delta
