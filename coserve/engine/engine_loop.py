"""Stepping an engine in a background thread, while other threads add requests and jobs under its lock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from coserve.engine.llm_engine import LLMEngine
from coserve.engine.outputs import RequestOutput

T = TypeVar("T")


class EngineLoop:
    """One thread runs ``engine.step()`` while there is work; ``call`` runs anything else on the engine
    between iterations. Finished request outputs are kept until ``wait_for`` collects them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.cond = threading.Condition()
        self.finished: dict[str, RequestOutput] = {}
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="coserve-engine", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self._stop or self.engine.scheduler.has_work())
                    if self._stop:
                        return
                    for out in self.engine.step():
                        if out.finished:
                            self.finished[out.request_id] = out
                    self.cond.notify_all()
        except BaseException as e:  # surfaced to every waiter rather than lost in the thread
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine between iterations, then wake the loop."""
        with self.cond:
            self._check()
            value = fn()
            self.cond.notify_all()
            return value

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait (between iterations) until ``predicate()`` holds; False on timeout."""
        with self.cond:
            done = self.cond.wait_for(lambda: self.error is not None or predicate(), timeout)
            self._check()
            return done

    def wait_for(self, request_ids: list[str]) -> list[RequestOutput]:
        """The final outputs of ``request_ids``, in that order, once all have finished."""
        self.wait_until(lambda: all(r in self.finished for r in request_ids))
        with self.cond:
            return [self.finished.pop(r) for r in request_ids]

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self.thread.join()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine loop stopped: {self.error!r}") from self.error
