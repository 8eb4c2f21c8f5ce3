"""``coserve bench-server --phase interleaved``: both paths in one run, on one server, at once.

The requests alternate by arrival: even-numbered ones go through HTTP, from the ``openai`` client in a process of
its own, and odd-numbered ones through the same server's own objects in its process, without HTTP (as the
in-process phase sends them); with ``--repeats``, every other run swaps them, so that over two runs each request
(its prompt and output lengths) has gone both ways. One engine serves both halves beside one fine-tuning job, so
each half's requests meet the same batches, the same job and the same machine: a machine whose speed drifts
between two phases run one after the other (20-40% within minutes on the 2-core hosts this was built on) moves
both halves alike, and the difference of their median TTFTs is what the HTTP path adds. What it leaves out is the
CPU the HTTP machinery (the server's event loop, the load client) takes from the engine: both halves bear it.

The server runs as ``coserve serve`` runs it (uvicorn, its event loop, its HTTP parser, the access log at INFO),
in a spawned host process that also drives the in-process half.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from coserve.bench.metrics import RequestRecord
from coserve.bench.server_load import (ClientJob, LoadSpec, add_logged_times, drive, end_job, free_port, http_client,
                                       inprocess_send, phase_app, start_job, warm_up)
from coserve.bench.spawned import context, run_spawned

START_DELAY_S = 0.2  # from both paths being warm to the load's first arrival: time for the start to reach both
READY_TIMEOUT_S = 300.0  # the host's model load and engine start, and the client's start, at most each


def halves(spec: LoadSpec, swap: bool = False) -> tuple[LoadSpec, LoadSpec]:
    """``(in-process, http)``: the spec's requests alternately, by arrival, the first through HTTP (``swap``: the
    first in-process); the job's data stays with the in-process half, whose host creates the job on the server's own
    objects."""
    first, second = (replace(spec, requests=spec.requests[i::2]) for i in (0, 1))
    inproc, http = (first, second) if swap else (second, first)
    return inproc, replace(http, finetune_jsonl=None)


def run_interleaved(spec: LoadSpec, swap: bool = False) -> dict[str, tuple[list[RequestRecord], dict]]:
    """``{"in-process": (records, extra), "http": (records, extra)}`` of one interleaved run (``swap``: as
    ``halves``; two runs, one swapped, send every request once each way). Both extras carry the run's seconds and
    fine-tuning tokens (one job served both halves); the HTTP half's records carry the engine's part of each TTFT,
    read from the server's access log."""
    inproc, http = halves(spec, swap)
    mp = context()
    parent, child = mp.Pipe()
    with tempfile.TemporaryDirectory(prefix="coserve-load-") as tmp:
        port, log_path = free_port(), f"{tmp}/server.log"
        host = mp.Process(target=_host, args=(child, inproc, port, f"{tmp}/state", log_path))
        host.start()
        child.close()
        ours, theirs = mp.Pipe()
        pool = ThreadPoolExecutor(1)  # the client process, waited for in a thread while its start is arranged
        try:
            model = _receive(parent, host, READY_TIMEOUT_S, "ready", log_path)
            job = ClientJob(http, f"http://127.0.0.1:{port}/v1", model, theirs)
            client = pool.submit(run_spawned, http_client, job, "the interleaved run's HTTP client")
            try:
                await_warm(ours, client, READY_TIMEOUT_S)
                start_at = time.time() + START_DELAY_S  # both paths warm: one start for both
                parent.send(start_at)
                ours.send(start_at)
            finally:
                ours.close()  # a client still waiting for its start gets EOFError and ends
            http_records, http_extra = client.result()
            parent.send("done")
            in_records, in_extra = _receive(parent, host, spec.timeout_s, "ok", log_path)
            host.join(timeout=60)
        finally:
            if host.is_alive():
                host.terminate()
                host.join(timeout=30)
            pool.shutdown()  # on an error, a client still in a request ends once the server is gone
        add_logged_times(http_records, http_extra.pop("ids"), Path(log_path).read_text(errors="replace"))
    run = {k: in_extra[k] for k in ("elapsed_s", "finetune_tokens", "job_status") if k in in_extra}
    return {"in-process": (in_records, in_extra), "http": (http_records, {**http_extra, **run})}


def await_warm(conn, client: Future, timeout_s: float) -> None:
    """Waits for the client's ``"warm"`` on ``conn``; the client's error, its end or its silence raise naming it."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.05):
        if client.done():
            client.result()  # its error, naming the client
            raise RuntimeError("the interleaved run's HTTP client ended before its warm-up request")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the interleaved run's HTTP client was not warm in {timeout_s:.0f} s")
    conn.recv()


def _receive(conn, host, timeout_s: float, expected: str, log_path: str):
    """The host's next message, which must be ``expected``; its error, its death or its silence raise naming it."""
    if not conn.poll(timeout_s):
        raise RuntimeError(f"the interleaved run's server host sent nothing in {timeout_s:.0f} s")
    try:
        kind, value = conn.recv()
    except EOFError:
        host.join(timeout=10)
        tail = Path(log_path).read_text(errors="replace")[-2000:] if Path(log_path).is_file() else ""
        raise RuntimeError(f"the interleaved run's server host died (exit code {host.exitcode}): {tail}") from None
    if kind != expected:
        raise RuntimeError(f"the interleaved run's server host failed: {value}")
    return value


def _host(conn, spec: LoadSpec, port: int, state_dir: str, log_path: str) -> None:
    """The spawned host: the server on ``port`` and the in-process half; messages ``("ready", model id)`` (the job
    started, the in-process path warmed up), then
    ``("ok", (records, extra))`` or ``("error", why)``."""
    import uvicorn
    logging.basicConfig(level=logging.INFO, filename=log_path,  # as ``coserve serve`` logs (uvicorn's lines too)
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = phase_app(spec, state_dir)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info", access_log=False,
                                               log_config=None))
        with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
            result = runner.run(_host_main(conn, spec, app, server))
        conn.send(("ok", result))
    except BaseException as e:  # reported to the parent, which names the run
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


async def _host_main(conn, spec: LoadSpec, app, server) -> tuple[list[RequestRecord], dict]:
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()
            raise RuntimeError("the server stopped before it started")
        await asyncio.sleep(0.05)
    try:
        ctx = app.state.coserve
        job, tokens0 = await start_job(ctx, spec)
        send = inprocess_send(ctx)
        await warm_up(send)
        conn.send(("ready", ctx.models.base))
        start_at = await asyncio.to_thread(conn.recv)
        records, _, _ = await drive(spec, send, start_at)
        await asyncio.to_thread(conn.recv)  # the HTTP half has finished too
        elapsed = time.time() - start_at  # the run's: both halves
        ft = await end_job(ctx, job, tokens0)
    finally:
        server.should_exit = True
        await serving
    return records, {"elapsed_s": elapsed, **ft}
