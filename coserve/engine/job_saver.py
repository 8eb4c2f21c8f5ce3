"""Writing a finished job's adapter off the engine thread.

A job's last optimizer step ends on the engine thread; its adapter and optimizer state are copied there
(``FinetuneJob.snapshot``) and written to disk on a thread of its own, so that the iterations serving
requests do not wait for the disk (a LoRA of r=16 on every linear module of an 8B model, with AdamW's two
moments, is about 0.5 GB to write). The job stays ``running`` until its files are whole, so that nothing
reads a half-written adapter; the engine collects finished writes between iterations.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from coserve.finetune.checkpoint import write_checkpoint
from coserve.finetune.job import FinetuneJob

log = logging.getLogger("coserve.engine")


class JobSaver:
    """Final saves in flight, by job id."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # started on the first save
        self._pending: dict[str, Future] = {}

    def submit(self, job_id: str, job: FinetuneJob) -> None:
        """On the engine thread: copy the job's checkpoint and start writing it to ``job.output_dir`` (after every
        write submitted before it: one thread, in order)."""
        self._pending[job_id] = self._executor().submit(write_checkpoint, job.output_dir, job.snapshot())

    def write_later(self, write) -> None:
        """A job's intermediate checkpoint write (``FinetuneJob.write_later``), on the same thread, in order; a
        failure is logged (the job trains on, its final save still to come)."""
        def run() -> None:
            try:
                write()
            except Exception:
                log.exception("writing a numbered checkpoint failed")
        self._executor().submit(run)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coserve-save")
        return self._pool

    def saving(self, job_id: str) -> bool:
        """Whether ``job_id``'s final write is in flight (its training is over)."""
        return job_id in self._pending

    def any_done(self) -> bool:
        """Whether a write has ended (any thread: a cheap look)."""
        return any(f.done() for f in list(self._pending.values()))

    def collect(self) -> dict[str, str | None]:
        """Writes that ended since the last call: job id -> None, or why the write failed."""
        ended = {}
        for job_id, future in list(self._pending.items()):
            if future.done():
                del self._pending[job_id]
                error = future.exception()
                if error is not None:
                    log.error("saving job %s's adapter failed", job_id, exc_info=error)
                ended[job_id] = None if error is None else f"saving the adapter failed: {error}"
        return ended
