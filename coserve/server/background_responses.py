"""OpenAI's background responses (``background: true`` on ``POST /v1/responses``): the request returns at once with
a stored response ``queued`` (or, with ``stream: true``, streams its events); the generation runs on the server, the
stored object going ``in_progress`` with its first token and ``completed`` (or ``incomplete``, ``failed``) at its
end, for ``GET /v1/responses/{id}`` to poll. Its events are kept as they are made (``event_log.py``), so that a
stream that dropped picks up where it left off (``GET /v1/responses/{id}?stream=true&starting_after=N``), while it
runs and for the last ``KEPT_LOGS`` finished ones. ``POST /v1/responses/{id}/cancel`` stops one (``cancelled``; its
engine requests aborted; a stream of it ends there). A server that stops first leaves none half-done: at its next
start the unfinished ones are ``failed``, naming why."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from coserve.server.choices import count_outcomes
from coserve.server.errors import APIError, bad_request, not_found
from coserve.server.event_log import EventLog

log = logging.getLogger("coserve.server")
RESTARTED = {"code": "server_error", "message": "The server stopped before the background response finished"}
KEPT_LOGS = 256  # finished background responses whose events a stream can still read (the most recent)


class BackgroundResponses:
    """The background responses generating now, by id (their tasks), and the events of those and of the last
    ``KEPT_LOGS`` finished ones; the event loop's alone."""

    def __init__(self) -> None:
        self.running: dict[str, asyncio.Task] = {}
        self.logs: OrderedDict[str, EventLog] = OrderedDict()

    async def start(self, ctx, shape) -> dict:
        """Store ``shape``'s response (its requests already submitted) as queued, and finish it in a task."""
        queued = shape.response(None, "queued")
        await asyncio.to_thread(ctx.store.add_response, shape.tenant, queued, shape.conversation)
        ident = shape.job.ident
        events = self.logs[ident] = EventLog()
        task = asyncio.create_task(self._finish(ctx, shape, events))
        self.running[ident] = task
        task.add_done_callback(lambda _: self._ended(ident))
        return queued

    def _ended(self, ident: str) -> None:
        self.running.pop(ident, None)
        finished = [i for i in self.logs if i not in self.running]
        for i in finished[:max(0, len(finished) - KEPT_LOGS)]:
            del self.logs[i]

    async def _finish(self, ctx, shape, events: EventLog) -> None:
        """Run the response's events into ``events``, saving its state as it goes (the final one is saved by the
        events themselves, ``ResponseShape.keep``)."""
        job, tenant = shape.job, shape.tenant
        saving = None  # the latest state being saved (shielded: it completes even when this task is cancelled)
        made = shape.events(ctx)
        try:
            async for event in made:
                events.append(event)
                out = job.choices[0].out
                if saving is None and out is not None and not out.finished:  # its first token: in progress
                    saving = self._save(ctx, tenant, shape.response(None, "in_progress"), shape.conversation)
                    await asyncio.shield(saving)
            if shape.failure is not None:  # told in the stored response: the server serves on
                log.warning("background response %s failed: %s", job.ident, shape.failure.message)
                await asyncio.shield(self._save(ctx, tenant, shape.failed_response(), shape.conversation))
        except asyncio.CancelledError:
            count_outcomes(job, ctx, "cancelled")
            if saving is not None:
                await asyncio.gather(saving, return_exceptions=True)  # not to land after the cancelled state
            await asyncio.shield(self._save(ctx, tenant, shape.response(None, "cancelled"), shape.conversation))
        finally:
            await made.aclose()  # (cancelled between two events: its requests aborted here)
            events.close()

    @staticmethod
    def _save(ctx, tenant: str, obj: dict, conversation: list[dict]) -> asyncio.Future:
        return asyncio.ensure_future(asyncio.to_thread(ctx.store.replace_response, tenant, obj, conversation))

    def events(self, response_id: str, stored: dict, starting_after: int | None) -> EventLog:
        """The kept events of the stored background response ``response_id`` (the caller's: ``stored``), to follow
        after ``starting_after``; a 400 naming ``stream`` where none are kept, naming ``starting_after`` below
        -1."""
        if not stored.get("background"):
            raise bad_request(f"stream: response {response_id!r} was not made in the background; only a background "
                              "response's events can be streamed again", "stream")
        events = self.logs.get(response_id)
        if events is None:
            raise bad_request(f"stream: the events of response {response_id!r} are no longer kept (the server keeps "
                              f"them while it runs and for the last {KEPT_LOGS} finished, until it restarts); "
                              "GET it without stream", "stream")
        if starting_after is not None and starting_after < -1:
            raise bad_request(f"starting_after: must be a sequence number >= -1, got {starting_after}",
                              "starting_after")
        return events

    def forget(self, response_id: str) -> None:
        """A deleted response's events go with it (a running one's task and its readers keep their own hold)."""
        self.logs.pop(response_id, None)

    async def stop(self) -> None:
        """At shutdown: cancel every one still generating (each stored ``cancelled``)."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def cancel(self, ctx, tenant: str, response_id: str) -> dict:
        """Stop the tenant's background response ``response_id`` and return it (as it ended, if it had)."""
        stored = ctx.store.get_response(tenant, response_id)
        if stored is None:
            raise not_found("response", response_id)
        if not stored[0].get("background"):
            raise APIError(400, "Only background responses can be cancelled", None, "response_not_cancellable")
        task = self.running.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return ctx.store.get_response(tenant, response_id)[0]
