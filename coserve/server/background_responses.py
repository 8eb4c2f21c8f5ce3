"""OpenAI's background responses (``background: true`` on ``POST /v1/responses``): the request returns at once with
a stored response ``queued``; the generation runs on the server, the stored object going ``in_progress`` with its
first token and ``completed`` (or ``incomplete``, ``failed``) at its end, for ``GET /v1/responses/{id}`` to poll.
``POST /v1/responses/{id}/cancel`` stops one (``cancelled``; its engine requests aborted). A server that stops
first leaves none half-done: at its next start the unfinished ones are ``failed``, naming why."""

from __future__ import annotations

import asyncio
import logging

from coserve.server.choices import advance, close_all, count_outcomes, run_to_end
from coserve.server.errors import APIError, not_found
from coserve.server.response_items import output_messages

log = logging.getLogger("coserve.server")
RESTARTED = {"code": "server_error", "message": "The server stopped before the background response finished"}


class BackgroundResponses:
    """The background responses generating now, by id (their tasks; the event loop's alone)."""

    def __init__(self) -> None:
        self.running: dict[str, asyncio.Task] = {}

    async def start(self, ctx, shape) -> dict:
        """Store ``shape``'s response (its requests already submitted) as queued, and finish it in a task."""
        queued = shape.response(None, "queued")
        await asyncio.to_thread(ctx.store.add_response, shape.tenant, queued, shape.conversation)
        task = asyncio.create_task(self._finish(ctx, shape))
        self.running[shape.job.ident] = task
        task.add_done_callback(lambda _: self.running.pop(shape.job.ident, None))
        return queued

    async def _finish(self, ctx, shape) -> None:
        job, tenant = shape.job, shape.tenant
        try:
            choice = job.choices[0]
            await advance(choice, job, ctx)
            if not choice.out.finished:
                await self._save(ctx, tenant, shape.response(None, "in_progress"),
                                 shape.conversation)
            await run_to_end(choice, job, ctx)
            final = shape.response(choice.out)
            count_outcomes(job, ctx, "ok")
            await self._save(ctx, tenant, final, shape.conversation + output_messages(final["output"]))
        except asyncio.CancelledError:
            await close_all(job)
            count_outcomes(job, ctx, "cancelled")
            await self._save(ctx, tenant, shape.response(None, "cancelled"),
                             shape.conversation)
        except Exception as e:  # told in the stored response: the server serves on
            await close_all(job)
            count_outcomes(job, ctx, "error")
            message = e.message if isinstance(e, APIError) else f"generation failed ({type(e).__name__}: {e})"
            log.warning("background response %s failed: %s", job.ident, message)
            await self._save(ctx, tenant, {**shape.response(None, "failed"),
                                           "error": {"code": "server_error", "message": message}}, shape.conversation)

    @staticmethod
    async def _save(ctx, tenant: str, obj: dict, conversation: list[dict]) -> None:
        await asyncio.shield(asyncio.to_thread(ctx.store.replace_response, tenant, obj, conversation))

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
