"""``coserve bench-server``: a load run on localhost through the HTTP server, against the same load on the
in-process engine.

Both phases run the same streamed chat requests (prompt texts and lengths from the ShareGPT trace, Poisson
arrivals at ``--rate``, a bounded count) beside the same fine-tuning job. The HTTP phase starts ``coserve
serve`` in a child process and drives it with the ``openai`` client's async API from another (at
``--client-nice``); the in-process phase builds the very same server objects (``build_app``) in a spawned
process and calls their engine client directly, with no HTTP, no JSON and no client process. The difference
of their TTFTs is what the HTTP layer adds. ``--phase interleaved`` runs both paths at once on one server instead
(``interleaved.py``), so that a machine's drift between the two phases does not count.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from coserve.bench.arrivals import poisson_arrivals
from coserve.bench.metrics import RequestRecord, percentile_stats, summarize
from coserve.bench.spawned import run_spawned
from coserve.bench.workload import DEFAULT_SHAREGPT, fit_length, load_sharegpt
from coserve.engine.slo_options import add_slo_arguments, slo_settings
from coserve.output_path import prepare_output
from coserve.server.config import DEFAULT_GIL_SWITCH_INTERVAL_MS
from coserve.server.middleware import ACCESS_LOGGER

DEFAULT_ALPACA = Path(__file__).resolve().parents[3] / "shared" / "data" / "alpaca_en_demo.json"
TENANT = "default"
CHAT_TEMPLATE_ROOM = 64  # tokens left for the chat template and re-tokenization drift
CLIENT_STREAMS = ("objects", "lines")  # how the HTTP phase's client reads a stream (``--client-stream``)
CLIENT_HTTPS = ("aiohttp", "httpx")  # the openai client's HTTP transport in the HTTP phase (``--client-http``)


def add_arguments(p) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--rate", type=float, default=2.0, help="mean arrival rate, requests/s (Poisson); 0 = one "
                   "request at a time (each sent when the last finished: the HTTP layer's cost without load)")
    p.add_argument("--prompts", default=None, help="ShareGPT-trace JSON (default: ../shared/data's, if there)")
    p.add_argument("--length-scale", type=float, default=0.5, help="prompt and output lengths x this")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens at most per request")
    p.add_argument("--finetune-data", default=None, help="JSON/JSONL Alpaca or chat records (default: "
                   "../shared/data/alpaca_en_demo.json); 'none' = no fine-tuning job")
    add_slo_arguments(p, "coserve: ")  # the server's, in both phases (--slo-tpot-ms also judges attainment)
    p.add_argument("--ttft-limit-s", type=float, default=5.0)
    p.add_argument("--phase", choices=["both", "http", "in-process", "interleaved"], default="both",
                   help="both: the in-process phase, then the HTTP phase (with --repeats, alternately first); "
                   "interleaved: one run on one server, the requests alternately through HTTP and in-process (both "
                   "halves meet the same engine and the same machine at once; with --repeats, every other run swaps "
                   "the halves: coserve/bench/interleaved.py)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a phase may take at most")
    p.add_argument("--repeats", type=int, default=1, help="run the phases this many times, alternating, and "
                   "compare the TTFTs of all their requests pooled (one run's median moves by several ms)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-nice", type=int, default=0, help="the HTTP phase's load client runs this much nicer "
                   "than the command (-20 to 19, below 0 needs root or CAP_SYS_NICE; the server keeps its own), to see "
                   "how much of the phases' difference is the client's CPU on the server's cores (on 2 cores, 19 moved "
                   "it from the engine's wait to the client's late reads; a negative value stands nearer a client on "
                   "cores of its own, which the engine's threads hardly slow: docs/benchmark-history.md)")
    p.add_argument("--client-stream", choices=CLIENT_STREAMS, default="objects", help="how the HTTP phase's "
                   "client reads each stream: objects, the openai client's chunk objects (as an application iterates "
                   "them); lines, the same client's with_streaming_response, each server-sent event's JSON read with "
                   "json.loads (as vLLM's benchmark_serving reads them): about half the client's CPU under load (the "
                   "CPU a client on the same few cores takes from the engine)")
    p.add_argument("--client-http", choices=CLIENT_HTTPS, default="aiohttp", help="the HTTP phase's openai client's "
                   "transport: aiohttp, the SDK's DefaultAioHttpClient (openai[aiohttp], which the SDK recommends for "
                   "concurrency: a request in one write, less CPU a chunk; docs/benchmark-history.md); httpx, the "
                   "SDK's default (headers and body in two writes)")
    p.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval (both phases): an "
                   "event every N tokens after the first")
    p.add_argument("--gil-switch-interval-ms", type=float, default=DEFAULT_GIL_SWITCH_INTERVAL_MS,
                   help="the server's (both phases)")
    p.add_argument("--out", default=None, help="JSON results")


@dataclass(slots=True)
class LoadSpec:
    """Everything a phase needs, picklable for the spawned process."""

    model: str
    requests: list[tuple[float, str, int]]  # (arrival offset s, user message, output tokens)
    finetune_jsonl: bytes | None  # the job's training file (chat JSONL), None for no job
    slo_tpot_s: float
    ttft_limit_s: float
    timeout_s: float
    dtype: str
    device: str | None
    seed: int
    client_nice: int = 0
    stream_interval: int = 1  # the server's --stream-interval, in both phases
    slo: dict = field(default_factory=dict)  # the server's SLO options (slo_options.SLO_FIELDS), in both phases
    gil_switch_interval_ms: float = DEFAULT_GIL_SWITCH_INTERVAL_MS  # the server's --gil-switch-interval-ms, both phases
    client_stream: str = "objects"  # CLIENT_STREAMS: the HTTP phase's client reads chunk objects or the events' lines
    client_http: str = "aiohttp"  # CLIENT_HTTPS: the HTTP phase's openai client's transport


# ---- the workload ---------------------------------------------------------------------------------------------
def build_requests(args, tokenizer) -> list[tuple[float, str, int]]:
    rng = random.Random(args.seed)
    path = Path(args.prompts) if args.prompts else DEFAULT_SHAREGPT
    if path.is_file():
        entries = load_sharegpt(path)
    else:  # ShareGPT-like log-normal lengths on synthetic text
        entries = [(f"Request {i}: explain how the scheduler batches work.", max(4, int(rng.lognormvariate(3.9, 1.4))),
                    max(2, int(rng.lognormvariate(4.6, 1.0)))) for i in range(args.num_requests)]
    if args.rate < 0:
        raise ValueError(f"--rate: must be >= 0, got {args.rate}")
    times = ([0.0] * args.num_requests if args.rate == 0 else
             poisson_arrivals(args.rate, args.num_requests / args.rate * 3, args.seed)[:args.num_requests])
    if len(times) < args.num_requests:
        raise ValueError(f"--num-requests: only {len(times)} arrivals drawn; lower it or raise --rate")
    from coserve.model.config import ModelConfig
    context = ModelConfig.from_dir(Path(args.model)).max_position_embeddings
    out = []
    for i, t in enumerate(times):
        text, p, r = entries[i % len(entries)]
        r = max(2, min(int(r * args.length_scale), args.max_tokens))
        room = context - r - CHAT_TEMPLATE_ROOM  # the chat template adds its own tokens around the message
        p = max(4, min(int(p * args.length_scale), args.max_prompt_len, room))
        ids = fit_length(tokenizer(text, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id or 0], p)
        out.append((t, tokenizer.decode(ids), r))
    return out


def finetune_jsonl(path: Path) -> bytes:
    """Alpaca or chat records as chat-format JSONL (what ``POST /v1/files`` takes)."""
    text = path.read_text()
    records = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    lines = []
    for r in records:
        if "messages" in r:
            lines.append({"messages": r["messages"]})
        elif "instruction" in r and "output" in r:
            user = r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")
            lines.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": r["output"]}]})
    if not lines:
        raise ValueError(f"--finetune-data: {path} has no Alpaca or chat record")
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


JOB = {"hyperparameters": {"n_epochs": 50, "batch_size": 1}}  # longer than any phase: cancelled at the end


WARM_UP = ("Say hello.", 1)  # the untimed request before a load: (user message, output tokens)


async def warm_up(send) -> None:
    """One untimed request through ``send`` (as ``drive`` sends them) before the load, as vLLM's
    ``benchmark_serving`` sends a test prompt: a path's first request pays its one-off costs (the ``openai`` client's
    lazy imports and its first connection, the server's first validation; 50-90 ms on a 2-core host), which no
    measured request should carry. Its failure raises, naming it."""
    try:
        await send(*WARM_UP, time.monotonic)
    except Exception as e:
        raise RuntimeError(f"the warm-up request before the load failed: {type(e).__name__}: {e}") from e


def one_at_a_time(spec: LoadSpec):
    """With every arrival at 0 (``--rate 0``) a lock sends one request at a time; else no limit."""
    if all(offset == 0 for offset, _, _ in spec.requests):
        return asyncio.Lock()
    return contextlib.nullcontext()


async def drive(spec: LoadSpec, send, start_at: float | None = None
                ) -> tuple[list[RequestRecord], list[str | None], float]:
    """Every request of ``spec`` at its arrival offset (one at a time for ``--rate 0``): their records, their
    response ids, and the seconds it took. ``send(message, max_tokens, clock)`` streams one and returns (first-token
    time on ``clock``, prompt tokens, output tokens, the engine's part of the TTFT if known, the response id if
    any); an exception counts as a failed request, with why. Offsets count from now, or from ``start_at`` (wall
    clock, ``time.time()``: two processes driving halves of one load share it)."""
    start = time.monotonic() + (0.0 if start_at is None else start_at - time.time())

    def clock() -> float:
        return time.monotonic() - start

    turn = one_at_a_time(spec)

    async def one(offset: float, message: str, max_tokens: int) -> tuple[RequestRecord, str | None]:
        async with turn:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            sent = clock()
            try:
                first, n_prompt, n_out, engine_ttft, ident = await send(message, max_tokens, clock)
            except Exception as e:  # counted as failed, with why
                return RequestRecord(sent, None, None, 0, 0, failed=True, error=f"{type(e).__name__}: {e}"), None
            return RequestRecord(sent, first, clock(), n_prompt, n_out, engine_ttft_s=engine_ttft), ident

    done = await asyncio.gather(*(one(*r) for r in spec.requests))
    return [record for record, _ in done], [ident for _, ident in done], clock()


# ---- the HTTP phase ---------------------------------------------------------------------------------------------
async def _http_requests(load: "ClientJob") -> tuple[list[RequestRecord], dict]:
    spec, model = load.spec, load.model
    client = openai_client(spec, load.base_url)
    job = None
    if spec.finetune_jsonl is not None:
        f = await client.files.create(file=("train.jsonl", io.BytesIO(spec.finetune_jsonl)), purpose="fine-tune")
        job = await client.fine_tuning.jobs.create(model=model, training_file=f.id, seed=spec.seed, **JOB)
        while (await client.fine_tuning.jobs.retrieve(job.id)).status == "queued":
            await asyncio.sleep(0.1)
    tokens0 = (await client.fine_tuning.jobs.retrieve(job.id)).trained_tokens or 0 if job else 0

    def body(message: str, max_tokens: int) -> dict:
        return dict(model=model, messages=[{"role": "user", "content": message}], max_tokens=max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})

    async def send_objects(message: str, max_tokens: int, clock):
        first, n_out, n_prompt, ident = None, 0, 0, None
        stream = await client.chat.completions.create(**body(message, max_tokens))
        async for chunk in stream:
            ident = chunk.id
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = clock()
            if chunk.usage is not None:
                n_out, n_prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        return first, n_prompt, n_out, None, ident  # the engine's part: from the server's log, once it stops

    async def send_lines(message: str, max_tokens: int, clock):
        first, n_out, n_prompt, ident = None, 0, 0, None
        async with client.chat.completions.with_streaming_response.create(**body(message, max_tokens)) as response:
            async for line in response.iter_lines():
                event = stream_event(line)
                if event is None:
                    continue
                ident = event.get("id", ident)
                choices = event.get("choices") or [{}]
                if first is None and choices[0].get("delta", {}).get("content"):
                    first = clock()
                if event.get("usage"):
                    n_out, n_prompt = event["usage"]["completion_tokens"], event["usage"]["prompt_tokens"]
        return first, n_prompt, n_out, None, ident

    send = send_lines if spec.client_stream == "lines" else send_objects
    await warm_up(send)
    start_at = None
    if load.start is not None:  # a load shared with another process: report warm, then take the common start
        load.start.send("warm")
        start_at = await asyncio.to_thread(load.start.recv)
    records, ids, elapsed = await drive(spec, send, start_at)
    ft = {}
    if job is not None:
        done = await client.fine_tuning.jobs.retrieve(job.id)
        ft = {"finetune_tokens": (done.trained_tokens or 0) - tokens0, "job_status": done.status}
        if done.status == "running":
            await client.fine_tuning.jobs.cancel(job.id)
    await client.close()
    return records, {"elapsed_s": elapsed, "ids": ids, **ft}


def check_client_http(name: str) -> None:
    """Raises naming ``--client-http`` where the transport ``name`` is not installed."""
    import importlib.util
    if name not in CLIENT_HTTPS:
        raise ValueError(f"--client-http: one of {', '.join(CLIENT_HTTPS)}, got {name!r}")
    if name == "httpx":  # the SDK's own default, always there
        return
    try:
        from openai import DefaultAioHttpClient  # noqa: F401  (not in older openai releases)
    except ImportError:
        missing = True
    else:
        missing = importlib.util.find_spec("aiohttp") is None
    if missing:
        raise ValueError("--client-http aiohttp: needs the openai client's aiohttp transport "
                         "(pip install 'openai[aiohttp]'); or give --client-http httpx")


def openai_client(spec: LoadSpec, base_url: str):
    """The load's ``AsyncOpenAI`` on ``spec.client_http``'s transport (the SDK's own aiohttp one, or its default)."""
    from openai import AsyncOpenAI
    check_client_http(spec.client_http)
    http = None
    if spec.client_http == "aiohttp":
        from openai import DefaultAioHttpClient
        http = DefaultAioHttpClient()
    return AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=spec.timeout_s, http_client=http)


def stream_event(line: str) -> dict | None:
    """One line of a chat completion stream: its event's JSON, or None for a blank line, a comment or ``[DONE]``; an
    error event raises (as the openai client's chunk iterator does), naming the server's message."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    event = json.loads(data)
    if isinstance(event, dict) and event.get("error") is not None:
        error = event["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise RuntimeError(f"the stream ended in an error: {message}")
    return event


def engine_ttfts(log_text: str) -> dict[str, tuple[float, float | None, float | None]]:
    """Response id -> the engine's part of its TTFT, the server's (arrival to the first token on the event loop),
    and the server's arrival to its first event of text (each None where not logged), in seconds, from the access
    log lines of a server's log."""
    found = {}
    for line in log_text.splitlines():
        _, sep, record = line.partition(f" {ACCESS_LOGGER}: ")
        if not sep:
            continue
        try:
            fields = json.loads(record)
        except json.JSONDecodeError:
            continue
        if isinstance(fields, dict) and "id" in fields and fields.get("engine_ttft_ms") is not None:
            found[fields["id"]] = tuple(None if (ms := fields.get(k)) is None else ms / 1000
                                        for k in ("engine_ttft_ms", "ttft_ms", "first_text_ms"))
    return found


def add_logged_times(records: list[RequestRecord], ids: list[str | None], log_text: str) -> None:
    """Each HTTP request's record gets the times its server logged (``engine_ttfts``), matched by response id."""
    logged = engine_ttfts(log_text)
    for record, ident in zip(records, ids):
        record.engine_ttft_s, record.server_ttft_s, record.server_text_s = logged.get(ident, (None, None, None))


def server_command(spec: LoadSpec, port: int, state_dir: str) -> list[str]:
    """The HTTP phase's ``coserve serve`` command line: the spec's model, dtype, device, stream interval and SLO
    options (those not None)."""
    cmd = [sys.executable, "-m", "coserve.cli", "serve", "--model", spec.model, "--state-dir", state_dir,
           "--port", str(port), "--dtype", spec.dtype, "--log-level", "info", "--max-waiting-requests",
           str(max(512, len(spec.requests))), "--stream-interval", str(spec.stream_interval),
           "--gil-switch-interval-ms", str(spec.gil_switch_interval_ms)]
    cmd += ["--device", spec.device] if spec.device else []
    return cmd + [arg for name, value in spec.slo.items() if value is not None
                  for arg in (f"--{name.replace('_', '-')}", str(value))]


def run_http(spec: LoadSpec) -> tuple[list[RequestRecord], dict]:
    """``coserve serve`` in a child process on a free port; the load from this process."""
    import subprocess

    import httpx
    with tempfile.TemporaryDirectory(prefix="coserve-load-") as tmp:
        port = free_port()
        cmd = server_command(spec, port, f"{tmp}/state")
        log = open(f"{tmp}/server.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}): {Path(tmp, 'server.log').read_text()[-2000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not start in 300 s")
                time.sleep(0.2)
            model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
            loop_cpu = thread_cpu_s(proc.pid, proc.pid)
            records, extra = run_spawned(http_client, ClientJob(spec, f"http://127.0.0.1:{port}/v1", model),
                                         "the HTTP phase's load client")
            after = thread_cpu_s(proc.pid, proc.pid)
            extra["server_loop_cpu_s"] = None if loop_cpu is None or after is None else after - loop_cpu
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        add_logged_times(records, extra.pop("ids"), Path(tmp, "server.log").read_text(errors="replace"))
        return records, extra


def thread_cpu_s(pid: int, tid: int) -> float | None:
    """CPU seconds one thread of a process has run (user + system, Linux's /proc); None where unreadable. The
    server's event loop is its main thread (uvicorn runs it there): ``thread_cpu_s(pid, pid)``."""
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


class ClientJob(NamedTuple):
    """What the HTTP load client process is given: the load, the server's base URL, the model's id, and where a
    shared load's start comes from: a pipe end (a ``multiprocessing`` connection) the client sends ``"warm"`` on once
    its warm-up request is done, then receives ``drive``'s ``start_at`` from (None: the load starts at once)."""

    spec: LoadSpec
    base_url: str
    model: str
    start: Any = None


def http_client(job: ClientJob) -> tuple[list[RequestRecord], dict]:
    """The HTTP phase's load, from its own process at ``spec.client_nice`` (a niceness cannot be undone, so the
    client cannot lower its own and then give the server a normal one)."""
    spec = job.spec
    nice = os.nice(spec.client_nice)
    cpu = time.process_time()
    records, extra = asyncio.run(_http_requests(job))
    return records, {**extra, "client_nice": nice, "client_stream": spec.client_stream, "client_http": spec.client_http,
                     "client_cpu_s": time.process_time() - cpu}


def check_client_nice(nice: int, client_runs: bool = True) -> None:
    """Raises naming ``--client-nice`` for a value out of -20..19, or, where a load client will run
    (``client_runs``), a negative one this user may not take (tried in a throwaway process, so that this one keeps
    its own)."""
    import subprocess
    if not -20 <= nice <= 19:
        raise ValueError(f"--client-nice: must be -20 to 19, got {nice}")
    if client_runs and nice < 0 and subprocess.run([sys.executable, "-c", f"import os; os.nice({nice})"],
                                                   capture_output=True).returncode:
        raise ValueError(f"--client-nice {nice}: lowering a niceness needs root or CAP_SYS_NICE")


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the in-process phase ---------------------------------------------------------------------------------------
def phase_app(spec: LoadSpec, state_dir: str):
    """The server's ASGI app for a phase, as ``coserve serve`` builds it from the spec's options (its engine starts
    with the app's lifespan)."""
    from coserve.engine.config import EngineConfig
    from coserve.server.app import build_app
    from coserve.server.config import ServerConfig
    return build_app(ServerConfig(model=spec.model, state_dir=state_dir, stream_interval=spec.stream_interval,
                                  gil_switch_interval_ms=spec.gil_switch_interval_ms),
                     EngineConfig(model=spec.model, dtype=spec.dtype, device=spec.device, **spec.slo))


async def start_job(ctx, spec: LoadSpec) -> tuple[dict | None, int]:
    """The spec's fine-tuning job created on the server's own objects, once it runs (None without data), and the
    server's count of finetuning tokens then."""
    from coserve.server.protocol import FineTuningJobRequest
    job = None
    if spec.finetune_jsonl is not None:
        f = ctx.store.add_file(TENANT, "train.jsonl", "fine-tune", spec.finetune_jsonl)
        job = ctx.jobs.create(TENANT, FineTuningJobRequest.model_validate(
            {"model": ctx.models.base, "training_file": f["id"], "seed": spec.seed, **JOB}))
        while ctx.store.get_job(TENANT, job["id"])["status"] == "queued":
            await asyncio.sleep(0.1)
    return job, ctx.metrics.finetune.total


async def end_job(ctx, job: dict | None, tokens0: int) -> dict:
    """The tokens ``job`` trained since ``tokens0`` and its status; cancelled if still running."""
    from coserve.server.jobs import POLL_S
    if job is None:
        return {}
    await asyncio.sleep(2 * POLL_S)  # let the job watcher count the last tokens
    ft = {"finetune_tokens": ctx.metrics.finetune.total - tokens0,
          "job_status": ctx.store.get_job(TENANT, job["id"])["status"]}
    if ft["job_status"] == "running":
        await asyncio.to_thread(ctx.jobs.cancel, TENANT, job["id"])
    return ft


def inprocess_send(ctx):
    """``drive``'s ``send`` on the server's own objects: the chat request validated, rendered and started as the
    chat route does, its outputs read from the engine client directly (no HTTP, no JSON)."""
    from coserve.server.inference_api import max_tokens_for, render_chat, sampling_params, start_choice
    from coserve.server.protocol import ChatCompletionRequest

    async def send(message: str, max_tokens: int, clock):
        body = ChatCompletionRequest.model_validate({
            "model": ctx.models.base, "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True})
        ids = render_chat(ctx, body)
        limit = max_tokens_for(ctx, len(ids), body.max_tokens, "max_tokens", "messages")
        choice = start_choice(ctx, TENANT, ids, sampling_params(body, limit, None, 0), None, 0, "messages")
        first, out, engine_ttft = None, None, None
        async for out in choice.stream:
            if engine_ttft is None and out.outputs[0].token_ids:
                engine_ttft = time.monotonic() - choice.stream.submitted_at
            if first is None and choice.delta.next(out.outputs[0].text, out.finished):
                first = clock()
        return first, len(ids), len(out.outputs[0].token_ids), engine_ttft, None

    return send


async def _inprocess_requests(spec: LoadSpec, state_dir: str) -> tuple[list[RequestRecord], dict]:
    app = phase_app(spec, state_dir)
    ctx = app.state.coserve
    async with app.router.lifespan_context(app):
        job, tokens0 = await start_job(ctx, spec)
        send = inprocess_send(ctx)
        await warm_up(send)
        records, _, elapsed = await drive(spec, send)
        ft = await end_job(ctx, job, tokens0)
    return records, {"elapsed_s": elapsed, **ft}


def _inprocess_phase(spec: LoadSpec) -> tuple[list[RequestRecord], dict]:
    with tempfile.TemporaryDirectory(prefix="coserve-load-") as tmp:
        return asyncio.run(_inprocess_requests(spec, f"{tmp}/state"))


def run_inprocess(spec: LoadSpec) -> tuple[list[RequestRecord], dict]:
    """The same load on the server's own objects in a fresh (spawned) process, without HTTP."""
    return run_spawned(_inprocess_phase, spec, "the in-process phase")


# ---- the command ------------------------------------------------------------------------------------------------
def phase_row(name: str, records: list[RequestRecord], extra: dict, spec: LoadSpec) -> dict:
    row = {"phase": name, **summarize(records, extra["elapsed_s"], spec.slo_tpot_s, spec.ttft_limit_s)}
    row["finetune_tokens_per_s"] = extra.get("finetune_tokens", 0) / extra["elapsed_s"]
    row["finetune_job_status"] = extra.get("job_status")
    row["client_nice"] = extra.get("client_nice")  # the HTTP load client's, as it saw it; None in-process
    row["client_stream"] = extra.get("client_stream")  # how it read the streams (CLIENT_STREAMS); None in-process
    row["client_http"] = extra.get("client_http")  # its transport (CLIENT_HTTPS); None in-process
    # the CPU time the HTTP load client took (all its threads), per request: what it takes from the engine's
    # cores when they are all the machine has
    cpu = extra.get("client_cpu_s")
    row["client_cpu_ms_per_request"] = None if cpu is None or not records else 1000 * cpu / len(records)
    loop = extra.get("server_loop_cpu_s")  # the server's event loop thread (HTTP phase only)
    row["server_loop_cpu_ms_per_request"] = None if loop is None or not records else 1000 * loop / len(records)
    row["errors"] = sorted({r.error for r in records if r.error})[:5]
    # each request's TTFT split: the engine's wait (submission to first token) and the rest, outside the engine
    done = [r for r in records if r.completed]
    row["engine_ttft_s"] = percentile_stats([r.engine_ttft_s for r in done if r.engine_ttft_s is not None])
    row["outside_engine_s"] = percentile_stats([r.outside_engine_s for r in done if r.outside_engine_s is not None])
    row["num_split"] = sum(r.outside_engine_s is not None for r in done)
    # the HTTP phase's time outside the engine, split where the server logged its own part: the server before the
    # engine, and the client and the wire (both ways)
    row["server_before_engine_s"] = percentile_stats([r.server_before_engine_s for r in done
                                                      if r.server_before_engine_s is not None])
    row["client_and_wire_s"] = percentile_stats([r.client_and_wire_s for r in done if r.client_and_wire_s is not None])
    row["held_text_s"] = percentile_stats([r.held_text_s for r in done if r.held_text_s is not None])  # part of it
    return row


def table(rows: list[dict]) -> str:
    def ms(v):
        return "n/a" if v is None else f"{v * 1000:.1f}"
    lines = ["| phase | requests | failed | SLO attainment | TTFT p50 ms | TTFT p90 ms | outside engine p50 ms "
             "| TPOT p50 ms | TPOT p90 ms | finetuning tok/s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['num_requests']} | {r['num_failed']} | {100 * r['slo_attainment']:.1f}% | "
                     f"{ms(r['ttft_s']['p50'])} | {ms(r['ttft_s']['p90'])} | {ms(r['outside_engine_s']['p50'])} | "
                     f"{ms(r['tpot_s']['p50'])} | {ms(r['tpot_s']['p90'])} | {r['finetune_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def http_added_ms(inprocess: dict | None, http: dict | None, key: str = "ttft_s") -> float | None:
    """The HTTP phase row's median of ``key`` less the in-process one's, in ms; None without both medians.
    ``ttft_s``: the phases' median TTFTs, which also differ by how the engine happened to schedule each phase;
    ``outside_engine_s``: each request's TTFT less its engine's wait, which leaves only the path to and from
    the engine."""
    a = inprocess[key]["p50"] if inprocess is not None else None
    b = http[key]["p50"] if http is not None else None
    return None if a is None or b is None else (b - a) * 1000


def run(args) -> int:
    from coserve.model.tokenizer import load_tokenizer
    if args.num_requests <= 0:
        raise ValueError(f"--num-requests: must be positive, got {args.num_requests}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be at least 1, got {args.repeats}")
    prepare_output("--out", args.out)
    check_client_nice(args.client_nice, client_runs=args.phase != "in-process")
    if args.phase != "in-process":
        check_client_http(args.client_http)
    tokenizer = load_tokenizer(args.model)
    requests = build_requests(args, tokenizer)
    data = None
    if args.finetune_data != "none":
        path = Path(args.finetune_data) if args.finetune_data else DEFAULT_ALPACA
        if not path.is_file():
            raise ValueError(f"--finetune-data: {path} is not a file (give one, or 'none')")
        data = finetune_jsonl(path)
    spec = LoadSpec(str(Path(args.model).resolve()), requests, data, args.slo_tpot_ms / 1000, args.ttft_limit_s,
                    args.timeout, args.dtype, args.device, args.seed, args.client_nice, args.stream_interval,
                    slo_settings(args), args.gil_switch_interval_ms, args.client_stream, args.client_http)
    phases = [(name, fn) for name, fn in (("in-process", run_inprocess), ("http", run_http))
              if args.phase in ("both", name)]
    rows, pairs = [], []  # pairs: each repeat's row by phase
    interleaved = args.phase == "interleaved"
    names = ("in-process", "http") if args.phase == "both" or interleaved else (args.phase,)
    pooled = {name: ([], {"elapsed_s": 0.0, "finetune_tokens": 0}) for name in names}
    how = "one at a time" if args.rate == 0 else f"at {args.rate} req/s"
    beside = " beside a fine-tuning job" if data else ""
    for repeat in range(args.repeats):
        suffix = "" if args.repeats == 1 else f" #{repeat + 1}"
        if interleaved:
            from coserve.bench.interleaved import run_interleaved
            print(f"interleaved{suffix}: {len(requests)} streamed chat requests {how}{beside}, alternately "
                  f"through HTTP and in-process on one server...", flush=True)
            done = run_interleaved(spec, swap=repeat % 2 == 1)
        else:
            done = {}
            # alternately first: a machine that drifts slower (or faster) through a run weighs on both phases alike
            for name, fn in (phases if repeat % 2 == 0 else phases[::-1]):
                print(f"{name}{suffix}: {len(requests)} streamed chat requests {how}{beside}...", flush=True)
                done[name] = fn(spec)
        pair = {}
        for name in names:
            records, extra = done[name]
            label = f"{name}{' (interleaved)' if interleaved else ''}{suffix}"
            pair[name] = phase_row(label, records, extra, spec)
            rows.append(pair[name])
            pooled[name][0].extend(records)
            pooled[name][1]["elapsed_s"] += extra["elapsed_s"]
            pooled[name][1]["finetune_tokens"] += extra.get("finetune_tokens", 0)
        pairs.append(pair)
    overall = pairs[0]
    if args.repeats > 1:
        mode = " interleaved" if interleaved else ""
        overall = {name: phase_row(f"{name} (all{mode})", records, extra, spec)
                   for name, (records, extra) in pooled.items()}
        rows += overall.values()
    print(table(rows))
    result = {"rows": rows, "phase": args.phase, "rate": args.rate, "num_requests": args.num_requests,
              "repeats": args.repeats,
              "model": args.model, "client_nice": args.client_nice, "client_stream": args.client_stream,
              "client_http": args.client_http, "stream_interval": args.stream_interval,
              "gil_switch_interval_ms": args.gil_switch_interval_ms, **slo_settings(args),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    added = http_added_ms(overall.get("in-process"), overall.get("http"))
    if added is not None:
        result["http_added_ttft_p50_ms"] = added
        each = [http_added_ms(p["in-process"], p["http"]) for p in pairs] if args.repeats > 1 else []
        result["http_added_ttft_p50_ms_by_repeat"] = each
        path = http_added_ms(overall["in-process"], overall["http"], "outside_engine_s")
        result["http_added_outside_engine_p50_ms"] = path
        note = f" (each pair: {', '.join(f'{a:+.1f}' for a in each if a is not None)})" if each else ""
        if path is not None:
            print(f"HTTP adds {path:+.1f} ms to the median TTFT outside the engine (in-process "
                  f"{1000 * overall['in-process']['outside_engine_s']['p50']:.1f} ms, HTTP "
                  f"{1000 * overall['http']['outside_engine_s']['p50']:.1f} ms per request; target <= 5 ms)")
        parts = "halves'" if interleaved else "phases'"
        print(f"The {parts} median TTFTs differ by {added:+.1f} ms{note}, the engine's scheduling of each included")
        wait = http_added_ms(overall["in-process"], overall["http"], "engine_ttft_s")
        result["http_added_engine_wait_p50_ms"] = wait
        if wait is not None:  # the rest of the difference: on a GPU, the HTTP work's share of the GIL shows here
            print(f"The engine's wait (submission to first token) p50: in-process "
                  f"{1000 * overall['in-process']['engine_ttft_s']['p50']:.1f} ms, HTTP "
                  f"{1000 * overall['http']['engine_ttft_s']['p50']:.1f} ms ({wait:+.1f} ms)")
    for row in rows:
        if row.get("client_cpu_ms_per_request") is not None:
            print(f"{row['phase']}: the load client (reading {row['client_stream']} over {row['client_http']}) took "
                  f"{row['client_cpu_ms_per_request']:.1f} ms of CPU per request "
                  f"({row['client_cpu_ms_per_request'] * row['num_requests'] / 1000 / row['duration_s']:.1%} of a core)"
                  + (f"; the server's event loop {row['server_loop_cpu_ms_per_request']:.1f} ms"
                     if row.get("server_loop_cpu_ms_per_request") is not None else ""))
        before, wire = row["server_before_engine_s"]["p50"], row["client_and_wire_s"]["p50"]
        if before is not None and wire is not None:
            held = row["held_text_s"]["p99"]
            of_which = "" if held is None else f", of which text held back after the first token: p99 {1000 * held:.1f}"
            print(f"{row['phase']}: outside the engine, p50 {1000 * before:.2f} ms in the server before it and "
                  f"{1000 * wire:.2f} ms in the client and on the wire (p99 "
                  f"{1000 * row['client_and_wire_s']['p99']:.1f}{of_which} ms)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0
