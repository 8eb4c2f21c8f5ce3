"""A background response's server-sent events, kept as they are made so that any number of readers can follow them
from any point (``GET /v1/responses/{id}?stream=true&starting_after=N``, a stream that reconnects): the log's event
``i`` is the one whose ``sequence_number`` is ``i``. The event loop's alone (no locks)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class EventLog:
    """Events in order; ``done`` once the last is in."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.done = False
        self._grew = asyncio.Event()  # set (and replaced) whenever an event is added or the log closes

    def append(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = asyncio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number ``after`` (-1: all), then each as it comes, until the log closes."""
        i = after + 1
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await self._grew.wait()
