"""Async access to the engine thread: submit a request, receive its outputs as they come, abort on disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from coserve.engine.engine_loop import EngineLoop
from coserve.engine.outputs import RequestOutput
from coserve.scheduler import Request
from coserve.server.errors import APIError


class EngineClient:
    """What the HTTP routes use of the engine; ``EngineLoop.post`` keeps the event loop from ever blocking
    on an iteration in flight."""

    def __init__(self, loop: EngineLoop, max_waiting_requests: int) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.max_waiting_requests = max_waiting_requests

    def check_capacity(self, new_requests: int) -> None:
        waiting = len(self.engine.scheduler.waiting)
        if waiting + new_requests > self.max_waiting_requests:
            raise APIError(503, f"The server is over capacity ({waiting} requests waiting); retry later",
                           code="server_overloaded")

    async def stream(self, request: Request, text: str | None) -> AsyncIterator[RequestOutput]:
        """Every output of ``request`` until it finishes; aborts it if the consumer stops early."""
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        rid = request.request_id

        def listener(out: RequestOutput | BaseException) -> None:
            aio.call_soon_threadsafe(queue.put_nowait, out)

        def submit() -> None:
            self.loop.listeners[rid] = listener
            try:
                self.engine.enqueue(request, text)
            except Exception as e:  # reported to the waiting route rather than lost
                self.loop.listeners.pop(rid, None)
                listener(e)

        finished = False
        self.loop.post(submit)
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise APIError(503, f"the engine could not run the request ({out})", code="engine_error")
                finished = out.finished
                yield out
        finally:
            if not finished:  # the client went away (or the route failed): free the request's KV blocks
                self.loop.post(lambda: self._abort(rid))

    def _abort(self, rid: str) -> None:
        self.loop.listeners.pop(rid, None)
        self.engine.abort_request(rid)


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
