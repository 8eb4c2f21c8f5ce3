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
        """On the engine thread: copy the job's checkpoint and start writing it to ``job.output_dir``."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coserve-save")
        self._pending[job_id] = self._pool.submit(write_checkpoint, job.output_dir, job.snapshot())

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
