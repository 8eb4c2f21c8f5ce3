"""OpenAI's Batch API, run inside the server: each request of a batch input file goes through the server's own
route (chat, completions or responses) as its tenant, in-process, a bounded number at a time across all
batches, beside the interactive traffic; the results become an output file (2xx) and an error file (the
rest), both ``batch_output`` files of the tenant.

Progress is durable: every finished request is appended to ``batches/<batch id>.jsonl`` under the state
directory before it counts, so a server restarted after a crash goes on with the requests not yet there.
A batch being cancelled stops taking new requests, lets those in flight finish and keeps their results; so
does one past its ``expires_at`` (24 hours after it was made), which ends ``expired``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from pathlib import Path

from coserve.server.batch_files import BatchLine, parse_batch_jsonl
from coserve.server.middleware import INTERNAL_TENANT
from coserve.server.store import Store

log = logging.getLogger("coserve.server")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINISHED = ("completed", "failed", "expired", "cancelled")
RETRY_STATUSES = (429, 503)  # the server is full: the request is tried again, not counted as failed
RETRY_SECONDS = 0.5
BATCH_PRIORITY = 1  # under the priority scheduling policy: batch requests wait behind interactive ones (0)
COUNTS_EVERY_S = 1.0  # how often request_counts are written while a batch runs


async def call_route(app, tenant: str, url: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` to the server's own ``url`` as ``tenant``, in-process; ``(status, JSON reply)``."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": url, "raw_path": url.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
             "client": ("batch", 0), "server": ("coserve", 0), INTERNAL_TENANT: tenant}
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # the caller never goes away
        return {"type": "http.disconnect"}

    status, chunks = 500, []

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    try:
        return status, json.loads(b"".join(chunks) or b"{}")
    except json.JSONDecodeError:
        return status, {"error": {"message": b"".join(chunks).decode("utf-8", "replace")[:1000], "type": "server_error",
                                  "param": None, "code": None}}


async def run_request(app, tenant: str, line: BatchLine, slots: asyncio.Semaphore,
                      priority: int | None = None) -> dict:
    """One batch request through the app (holding one of ``slots`` while it runs; retried while the server is
    full), as the line of an output or error file. ``priority``: what a request that names none gets (under the
    priority scheduling policy, ``BATCH_PRIORITY`` puts batch requests behind interactive ones)."""
    body = line.body
    if priority is not None and line.url != "/v1/responses":
        body = {"priority": priority, **body}
    while True:
        async with slots:
            status, body_out = await call_route(app, tenant, line.url, body)
        if status not in RETRY_STATUSES:
            break
        await asyncio.sleep(RETRY_SECONDS)
    request_id = body_out.get("id") if isinstance(body_out.get("id"), str) else f"req_{secrets.token_hex(12)}"
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body_out}, "error": None}


class BatchRunner:
    """Runs the server's batches; ``start`` and everything after it on the server's event loop."""

    def __init__(self, store: Store, state_dir: Path | str, concurrency: int = 4, priority: int | None = None) -> None:
        self.store = store
        self.dir = Path(state_dir) / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.concurrency = concurrency
        self.priority = priority  # given to requests that name none (run_request)
        self.app = None  # the ASGI app the requests go through (set once it is built)
        self._tasks: dict[str, asyncio.Task] = {}
        self._slots: asyncio.Semaphore | None = None
        self._cancelled: set[str] = set()  # batches being cancelled (the store says so too; read per line here)

    def start(self) -> None:
        """Go on with every batch a previous run left unfinished."""
        self._slots = asyncio.Semaphore(self.concurrency)
        for tenant, batch in self.store.batches_with_status(*ACTIVE):
            if batch["status"] == "cancelling":
                self._cancelled.add(batch["id"])
            self.submit(tenant, batch["id"])

    def cancel(self, batch_id: str) -> dict:
        """Mark the batch cancelling: its workers stop taking lines, and it ends with what is done."""
        self._cancelled.add(batch_id)
        return self.store.update_batch(batch_id, status="cancelling", cancelling_at=int(time.time()))

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    def submit(self, tenant: str, batch_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._run(tenant, batch_id))
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def _run(self, tenant: str, batch_id: str) -> None:
        try:
            await self._process(tenant, batch_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a batch that cannot go on fails; the server keeps serving
            log.exception("batch %s failed", batch_id)
            self.store.update_batch(batch_id, status="failed", failed_at=int(time.time()),
                                    errors={"object": "list", "data": [{"code": "batch_failed", "message": str(e),
                                                                        "param": None, "line": None}]})

    async def _process(self, tenant: str, batch_id: str) -> None:
        batch = self.store.get_batch(tenant, batch_id)
        data = await asyncio.to_thread(self.store.file_path(batch["input_file_id"]).read_bytes)
        lines = await asyncio.to_thread(parse_batch_jsonl, data)
        progress = self.dir / f"{batch_id}.jsonl"
        done = _read_progress(progress)
        counts = _counts(len(lines), done.values())
        if batch["status"] == "validating":
            batch = self.store.update_batch(batch_id, status="in_progress", in_progress_at=int(time.time()),
                                            request_counts=counts)
        pending = iter([line for line in lines if line.custom_id not in done])
        written = {"at": time.monotonic()}
        with progress.open("a", encoding="utf-8") as out:
            async def worker() -> None:
                for line in pending:
                    if batch_id in self._cancelled or time.time() >= batch["expires_at"]:
                        return
                    record = await self._request(tenant, line)
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                    out.flush()
                    done[line.custom_id] = record
                    counts["completed" if record["response"]["status_code"] < 300 else "failed"] += 1
                    if time.monotonic() - written["at"] > COUNTS_EVERY_S:
                        written["at"] = time.monotonic()
                        self.store.update_batch(batch_id, request_counts=dict(counts))

            await asyncio.gather(*(worker() for _ in range(min(self.concurrency, len(lines)))))
        await self._finish(tenant, batch_id, lines, done, expired=len(done) < len(lines)
                           and time.time() >= batch["expires_at"])
        progress.unlink(missing_ok=True)

    async def _request(self, tenant: str, line: BatchLine) -> dict:
        return await run_request(self.app, tenant, line, self._slots, self.priority)

    async def _finish(self, tenant: str, batch_id: str, lines: list[BatchLine], done: dict[str, dict],
                      expired: bool = False) -> None:
        cancelled = batch_id in self._cancelled
        self._cancelled.discard(batch_id)
        self.store.update_batch(batch_id, status="cancelling" if cancelled else "finalizing",
                                **({} if cancelled else {"finalizing_at": int(time.time())}))
        ordered = [done[line.custom_id] for line in lines if line.custom_id in done]  # the input's order
        ok = [r for r in ordered if r["response"]["status_code"] < 300]
        failed = [r for r in ordered if r["response"]["status_code"] >= 300]
        files = {}
        for key, records, name in (("output_file_id", ok, "output"), ("error_file_id", failed, "error")):
            if records:
                data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
                made = await asyncio.to_thread(self.store.add_file, tenant, f"{batch_id}_{name}.jsonl",
                                               "batch_output", data, result_file_id(batch_id, name))
                files[key] = made["id"]
        now = int(time.time())
        status = "cancelled" if cancelled else "expired" if expired else "completed"
        self.store.update_batch(batch_id, status=status, **{f"{status}_at": now},
                                request_counts=_counts(len(lines), ordered), **files)


def result_file_id(batch_id: str, name: str) -> str:
    """The id of a batch's output or error file, the same each time: a finalization that a crash cut short and
    that runs again after the restart finds the file it wrote, rather than writing a second one."""
    return "file-" + hashlib.sha256(f"{batch_id}/{name}".encode()).hexdigest()[:24]


def _read_progress(path: Path) -> dict[str, dict]:
    """The finished requests a previous run recorded; a torn last line (a crash mid-write) is cut off the file,
    so that what is appended next starts on a line of its own."""
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    data = path.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole < len(data):
        with path.open("r+b") as f:
            f.truncate(whole)
    for raw in data[:whole].decode("utf-8").splitlines():
        record = json.loads(raw)
        done[record["custom_id"]] = record
    return done


def _counts(total: int, records) -> dict:
    records = list(records)
    completed = sum(r["response"]["status_code"] < 300 for r in records)
    return {"total": total, "completed": completed, "failed": len(records) - completed}
