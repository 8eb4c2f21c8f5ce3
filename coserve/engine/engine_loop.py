"""Stepping an engine in a background thread, while other threads add requests and jobs under its lock."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from coserve.engine.llm_engine import LLMEngine
from coserve.engine.outputs import RequestOutput

T = TypeVar("T")
log = logging.getLogger("coserve.engine")
IDLE_POLL_S = 0.005  # an idle loop also looks for posted work this often (a post that lost the race to notify)
ALIVE_CHECK_S = 0.5  # a caller waiting on a posted call looks this often whether the loop still runs
MAX_FAULTS, FAULT_WINDOW_S = 3, 60.0  # this many engine faults within this many seconds stop the loop


class EngineLoop:
    """One thread runs ``engine.step()`` while there is work; ``call`` runs anything else on the engine
    between iterations, and ``post`` queues work without waiting for the iteration in flight (for an event
    loop that must not block). A request with a listener gets every output it produces, from the engine
    thread; other finished request outputs are kept until ``wait_for`` collects them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.cond = threading.Condition()
        self.finished: dict[str, RequestOutput] = {}
        # request id -> called with each output (from the engine thread), or with the error that stopped the loop
        self.listeners: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._posted: deque[Callable[[], None]] = deque()
        self._arrivals: deque[None] = deque()  # one per new request handed over and not yet in the engine
        engine.executor.arrivals = self.arrival_waiting  # a long finetuning slice makes way for them
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self._stop = False
        self._faults: list[float] = []  # when engine.step() last raised (reset_after_fault)
        self.thread = threading.Thread(target=self._run, name="coserve-engine", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.cond.wait_for(self._ready, IDLE_POLL_S):
                        pass
                    if self._stop:
                        return
                    self._run_posted()
                    if self.engine.collect_saves():  # a finished job's adapter is on disk: its waiters wake
                        self.cond.notify_all()
                    if not self.engine.scheduler.has_work():
                        continue
                    for out in self._step():
                        listener = self.listeners.get(out.request_id)
                        if listener is not None:
                            if out.finished:
                                del self.listeners[out.request_id]
                            listener(out)
                        elif out.finished:
                            self.finished[out.request_id] = out
                    self.cond.notify_all()
        except BaseException as e:  # surfaced to every waiter and listener rather than lost in the thread
            with self.cond:
                self.error = e
                listeners, self.listeners = self.listeners, {}
                for listener in listeners.values():
                    listener(e)
                self.cond.notify_all()

    def _step(self) -> list[RequestOutput]:
        """``engine.step()``; where it raises (a failed model iteration is handled inside it: this is its own
        bookkeeping), every request and job fails and the engine starts over, unless that keeps happening
        (``MAX_FAULTS`` within ``FAULT_WINDOW_S``): then the loop stops and ``/health`` says so."""
        try:
            return self.engine.step()
        except Exception as e:
            now = time.monotonic()
            self._faults = [t for t in self._faults if now - t < FAULT_WINDOW_S] + [now]
            if len(self._faults) >= MAX_FAULTS:
                raise
            return self.engine.reset_after_fault(e)

    def _ready(self) -> bool:
        return (self._stop or bool(self._posted) or self.engine.scheduler.has_work()
                or self.engine.saves_ended())

    def _run_posted(self) -> None:
        while self._posted:
            fn = self._posted.popleft()
            try:
                fn()
            except Exception:  # a posted call reports its own errors; one that raises must not stop the engine
                log.exception("a call posted to the engine loop failed")

    def arrival_waiting(self) -> bool:
        """Whether a new request was handed over (``arrival=True``) and waits for the iteration in flight."""
        return bool(self._arrivals)

    def _as_arrival(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn``, counted as a new request's arrival until it runs (deque appends and pops are atomic)."""
        self._arrivals.append(None)

        def arrive() -> T:
            self._arrivals.popleft()
            return fn()
        return arrive

    def post(self, fn: Callable[[], None], arrival: bool = False) -> None:
        """Run ``fn`` on the engine thread before its next iteration; returns at once, never blocks.
        ``arrival``: ``fn`` hands the engine a new request, so the iteration in flight cuts its finetuning
        slice short (``ModelExecutor.arrivals``) rather than keep the request waiting."""
        self._check()
        self._posted.append(self._as_arrival(fn) if arrival else fn)
        if self.cond.acquire(blocking=False):  # idle: wake it now (busy: it drains the queue after its iteration)
            try:
                self.cond.notify_all()
            finally:
                self.cond.release()

    def post_future(self, fn: Callable[[], T], arrival: bool = False) -> concurrent.futures.Future:
        """``post`` ``fn``; the future gets what it returns or raises."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # the caller's to handle
                    future.set_exception(e)
        self.post(work, arrival)
        return future

    def check_alive(self) -> None:
        """Raise if the loop has stopped (a posted call would never run)."""
        if self.error is not None or not self.thread.is_alive():
            raise RuntimeError(f"the engine loop stopped ({self.error!r}) before running a posted call") from self.error

    def post_and_wait(self, fn: Callable[[], T], arrival: bool = False) -> T:
        """Run ``fn`` on the engine thread before its next iteration and return what it returns (raise what it
        raises), from any thread but the engine's. Posted work runs first at every iteration, so this waits one
        iteration at most; ``call`` instead competes for the loop's lock with an engine thread that takes it
        back right after each iteration (waits of seconds were measured while jobs trained)."""
        future = self.post_future(fn, arrival)
        while True:
            try:
                return future.result(timeout=ALIVE_CHECK_S)
            except concurrent.futures.TimeoutError:
                self.check_alive()

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
