"""Running one benchmark phase in a fresh process, so that threads, core affinity and allocator state never
leak between runs; its value or its error comes back through a pipe.

Where no GPU is visible the processes are forked from a ``forkserver`` that has imported the engine, the server
and the load client once (torch and transformers alone take about 5 s to import on a 2-core CPU, paid by every
spawned run before); the server process itself has run nothing, so each run still starts from a clean state.
Where a GPU is visible they are spawned, since a forked process must never inherit a CUDA context.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import traceback
from collections.abc import Callable
from typing import Any

# What the fork server imports once: everything a benchmark run, phase or client imports (and ``coserve serve``,
# which the test suite's live servers fork from it: tests/server_helpers.py).
PRELOAD = ("coserve.bench.serving_run", "coserve.bench.server_load", "coserve.bench.interleaved",
           "coserve.engine.llm_engine", "coserve.server.app", "coserve.server.serve_command", "coserve.cli",
           "uvicorn", "openai", "httpx")


@functools.cache
def context() -> multiprocessing.context.BaseContext:
    """The context benchmark processes start from (``COSERVE_BENCH_START=spawn|forkserver`` overrides)."""
    method = os.environ.get("COSERVE_BENCH_START") or ("spawn" if _gpu_visible() else "forkserver")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"COSERVE_BENCH_START: {method!r} is not spawn or forkserver")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _gpu_visible() -> bool:
    import torch
    return torch.cuda.is_available()


def _child(conn, env: dict[str, str], fn: Callable[[Any], Any], arg: Any) -> None:
    try:
        if os.environ != env:  # a fork server's environment is the one it started with: the caller's rules
            os.environ.clear()
            os.environ.update(env)
        conn.send(("ok", fn(arg)))
    except BaseException as e:  # reported to the parent, which names the run
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_spawned(fn: Callable[[Any], Any], arg: Any, what: str) -> Any:
    """``fn(arg)`` in a fresh process (``fn`` a module-level function, ``arg`` picklable); errors name ``what``."""
    ctx = context()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, dict(os.environ), fn, arg))
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
