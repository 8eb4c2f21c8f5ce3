"""Running one benchmark phase in a fresh (spawned) process, so that threads, core affinity and allocator state
never leak between runs; its value or its error comes back through a pipe."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any


def _child(conn, fn: Callable[[Any], Any], arg: Any) -> None:
    try:
        conn.send(("ok", fn(arg)))
    except BaseException as e:  # reported to the parent, which names the run
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_spawned(fn: Callable[[Any], Any], arg: Any, what: str) -> Any:
    """``fn(arg)`` in a spawned process (``fn`` a module-level function, ``arg`` picklable); errors name ``what``."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, fn, arg))
    proc.start()
    child.close()
    try:
        status, value = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"{what}: the process died (exit code {proc.exitcode})")
    proc.join()
    if status != "ok":
        raise RuntimeError(f"{what} failed: {value}")
    return value
