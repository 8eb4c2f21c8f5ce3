"""What ``LLM.finetune`` returns: a running job to watch, wait for or cancel."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class FinetuneHandle:
    """A finetuning job co-served by an ``LLM``'s engine."""

    def __init__(self, llm: Any, job_id: str, output_dir: Path, data_report: str) -> None:
        self._llm = llm
        self.job_id = job_id
        self.output_dir = output_dir  # the adapter (HF PEFT format) and training_log.jsonl, when it ends
        self.data_report = data_report  # what loading the data set found (examples, skipped lines)

    def status(self) -> dict:
        """``{"job_id", "status" (running/succeeded/failed/cancelled), "error", "step", "total_steps", "tokens_done", "loss"}``."""
        def read() -> dict:
            state = self._llm.engine.job_states[self.job_id]
            job = state.job
            return {"job_id": self.job_id, "status": state.status, "error": state.error, "step": job.step,
                    "total_steps": job.total_steps, "tokens_done": job.tokens_done,
                    "loss": job.log[-1].loss if job.log else None}
        return self._llm._background().call(read)

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the job has ended (or ``timeout`` seconds passed); returns ``status()``."""
        states = self._llm.engine.job_states
        self._llm._background().wait_until(lambda: states[self.job_id].status != "running", timeout)
        return self.status()

    def cancel(self) -> None:
        """Stop the job; raises ValueError when it has already ended."""
        self._llm._background().call(lambda: self._llm.engine.cancel_finetune_job(self.job_id))
