"""The batch runner on a stand-in ASGI app (no model): output and error files in input order, resuming from its
progress file (a torn last line included) without running a request twice, expiry, cancellation, and the
priority given to requests that name none."""

from __future__ import annotations

import asyncio
import json
import time

from coserve.server.batches import BatchRunner
from coserve.server.store import Store


class EchoApp:
    """Answers every POST with 200 and the body it got (400 when the body asks to fail); counts calls."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        body = json.loads((await receive())["body"])
        self.calls.append(body)
        status = 400 if body.get("fail") else 200
        reply = {"error": {"message": "asked to fail"}} if status == 400 else {"id": f"r-{body['n']}", "got": body}
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(reply).encode()})


def make_batch(store: Store, n: int, expires_in: float = 3600, status: str = "validating", **extra) -> str:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"n": i, **({"fail": True} if i == 1 else {}), **extra}} for i in range(n)]
    f = store.add_file("alice", "in.jsonl", "batch", "".join(json.dumps(x) + "\n" for x in lines).encode())
    now = int(time.time())
    store.add_batch("alice", {"id": "batch_1", "object": "batch", "status": status, "input_file_id": f["id"],
                              "created_at": now, "expires_at": now + expires_in,
                              "request_counts": {"total": n, "completed": 0, "failed": 0}})
    return "batch_1"


def run(store: Store, tmp_path, app, priority=None) -> dict:
    async def go():
        runner = BatchRunner(store, tmp_path, concurrency=3, priority=priority)
        runner.app = app
        runner.start()  # takes up every unfinished batch, as after a restart
        await asyncio.gather(*runner._tasks.values())
    asyncio.run(go())
    return store.get_batch("alice", "batch_1")


def contents(store: Store, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in store.file_path(file_id).read_text().splitlines()]


def test_a_batch_ends_with_output_and_error_files_in_input_order(tmp_path):
    store, app = Store(tmp_path), EchoApp()
    make_batch(store, 6)
    batch = run(store, tmp_path, app)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
    out = contents(store, batch["output_file_id"])
    assert [r["custom_id"] for r in out] == ["c0", "c2", "c3", "c4", "c5"]
    assert out[0]["response"] == {"status_code": 200, "request_id": "r-0", "body": {"id": "r-0", "got": {"n": 0}}}
    (err,) = contents(store, batch["error_file_id"])
    assert err["custom_id"] == "c1" and err["response"]["status_code"] == 400
    assert sorted(c["n"] for c in app.calls) == list(range(6)) and not (tmp_path / "batches" / "batch_1.jsonl").exists()


def test_a_restart_goes_on_from_the_progress_file_and_runs_nothing_twice(tmp_path):
    store, app = Store(tmp_path), EchoApp()
    make_batch(store, 6, status="in_progress")
    progress = tmp_path / "batches" / "batch_1.jsonl"
    progress.parent.mkdir(parents=True, exist_ok=True)
    done = [{"id": f"batch_req_{i}", "custom_id": f"c{i}", "response": {"status_code": 200, "request_id": f"r-{i}",
                                                                      "body": {"before": True}}, "error": None}
            for i in (0, 4)]
    progress.write_text("".join(json.dumps(r) + "\n" for r in done) + '{"id": "batch_req_torn", "cust')
    batch = run(store, tmp_path, app)
    assert sorted(c["n"] for c in app.calls) == [1, 2, 3, 5]  # the torn line's request runs again, once
    out = contents(store, batch["output_file_id"])
    assert [r["custom_id"] for r in out] == ["c0", "c2", "c3", "c4", "c5"]
    assert out[0]["response"]["body"] == {"before": True} and out[3]["response"]["body"] == {"before": True}


def test_past_its_expiry_a_batch_takes_no_more_requests_and_ends_expired(tmp_path):
    store, app = Store(tmp_path), EchoApp()
    make_batch(store, 4, expires_in=-1)
    batch = run(store, tmp_path, app)
    assert batch["status"] == "expired" and batch["expired_at"] is not None and app.calls == []
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 0} and "output_file_id" not in batch


def test_a_cancelled_batch_ends_cancelled(tmp_path):
    store, app = Store(tmp_path), EchoApp()
    make_batch(store, 4, status="cancelling")
    batch = run(store, tmp_path, app)
    assert batch["status"] == "cancelled" and app.calls == []


def test_requests_naming_no_priority_get_the_runners(tmp_path):
    store, app = Store(tmp_path), EchoApp()
    make_batch(store, 3)
    run(store, tmp_path, app, priority=1)
    assert [c["priority"] for c in app.calls] == [1, 1, 1]
    store2, app2 = Store(tmp_path / "other"), EchoApp()
    make_batch(store2, 2, priority=-3)  # a request's own priority stays
    run(store2, tmp_path / "other", app2, priority=1)
    assert [c["priority"] for c in app2.calls] == [-3, -3]


class Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs, no handler sees it."""


def test_a_finalization_cut_short_and_run_again_writes_each_result_file_once(tmp_path):
    store, app = Store(tmp_path), EchoApp()
    make_batch(store, 4)
    update = store.update_batch

    def killed_before_completing(batch_id, **fields):
        if fields.get("status") == "completed":
            raise Killed  # the output and error files are stored; the batch row does not say so yet
        return update(batch_id, **fields)
    store.update_batch = killed_before_completing
    try:
        run(store, tmp_path, app)
    except Killed:
        pass
    else:
        raise AssertionError("the stand-in kill did not happen")
    store.update_batch = update
    assert store.get_batch("alice", "batch_1")["status"] == "finalizing"
    batch = run(store, tmp_path, app)  # the restart
    assert batch["status"] == "completed" and len(app.calls) == 4  # no request ran twice
    outputs = [f for f in store.list_files("alice") if f["purpose"] == "batch_output"]
    assert sorted(f["id"] for f in outputs) == sorted([batch["output_file_id"], batch["error_file_id"]])
    assert [r["custom_id"] for r in contents(store, batch["output_file_id"])] == ["c0", "c2", "c3"]
