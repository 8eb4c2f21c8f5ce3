"""The server's SQLite store: files, jobs, events, checkpoints, threads, durability."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from coserve.server.store import Store


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state")
    yield s
    s.close()


def _job(status: str = "queued", **extra) -> dict:
    return {"id": Store.new_id("ftjob"), "object": "fine_tuning.job", "status": status,
            "created_at": 1_700_000_000, "model": "tiny", **extra}


# ---- layout and tenants

def test_creates_layout_and_schema(tmp_path):
    from coserve.server import store as store_module
    s = Store(tmp_path / "a" / "b")
    try:
        assert (tmp_path / "a" / "b" / "state.db").is_file()
        assert (tmp_path / "a" / "b" / "files").is_dir()
        assert s._conn.execute("PRAGMA user_version").fetchone()[0] == store_module.SCHEMA_VERSION == 8
        assert s._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    finally:
        s.close()


def test_a_version_1_state_directory_is_brought_up_to_date_and_keeps_its_jobs(tmp_path):
    import sqlite3

    from coserve.server import store as store_module
    conn = sqlite3.connect(tmp_path / "state.db")  # what the first server made
    conn.executescript(f"BEGIN; {store_module._SCHEMA} PRAGMA user_version = 1; COMMIT;")
    conn.execute("INSERT INTO tenants VALUES ('alice', 1)")
    conn.execute("INSERT INTO jobs (id, tenant, status, created_at, obj) VALUES ('ftjob-1', 'alice', 'queued', 1, "
                 "'{\"id\": \"ftjob-1\", \"status\": \"queued\"}')")
    conn.commit()
    conn.close()
    s = Store(tmp_path)
    try:
        assert s._conn.execute("PRAGMA user_version").fetchone()[0] == 8
        assert s.get_job("alice", "ftjob-1")["status"] == "queued"
        s.add_response("alice", {"id": "resp_1", "created_at": 5}, [{"role": "user", "content": "hi"}])
        assert s.get_response("alice", "resp_1") == ({"id": "resp_1", "created_at": 5},
                                                     [{"role": "user", "content": "hi"}])
        assert s.get_response("bob", "resp_1") is None and not s.delete_response("bob", "resp_1")
        assert s.delete_response("alice", "resp_1") and s.get_response("alice", "resp_1") is None
        s.add_batch("alice", {"id": "batch_1", "status": "validating", "created_at": 7})
        assert s.update_batch("batch_1", status="in_progress")["status"] == "in_progress"
        assert s.get_batch("bob", "batch_1") is None
        assert [b["id"] for _, b in s.batches_with_status("in_progress")] == ["batch_1"]
        assert s.list_batches("alice") == ([s.get_batch("alice", "batch_1")], False)
        s.add_upload("alice", {"id": "upload-" + "0" * 24, "status": "pending", "created_at": 9})
        assert s.get_upload("alice", "upload-" + "0" * 24)["status"] == "pending"
        for i in (1, 2, 3):
            s.add_eval("alice", {"id": f"eval_{i}", "object": "eval", "created_at": i})
        assert [e["id"] for e in s.list_evals("alice", limit=2)[0]] == ["eval_1", "eval_2"]  # oldest first
        assert s.list_evals("alice", after="eval_1", ascending=False) == ([], False)
        assert [e["id"] for e in s.list_evals("alice", after="eval_3", ascending=False)[0]] == ["eval_2", "eval_1"]
        assert s.get_eval("bob", "eval_1") is None and s.update_eval("eval_1", name="x")["name"] == "x"
        s.add_eval_run("alice", {"id": "evalrun_1", "eval_id": "eval_1", "status": "queued", "created_at": 1})
        s.add_eval_item("evalrun_1", {"id": "outputitem_1", "datasource_item_id": 0, "status": "pass"})
        s.add_eval_item("evalrun_1", {"id": "outputitem_2", "datasource_item_id": 0, "status": "fail"})  # once
        assert [x["id"] for x in s.eval_items_done("evalrun_1")] == ["outputitem_1"]
        assert s.list_eval_items("evalrun_1", status="fail") == ([], False)
        assert not s.delete_eval("bob", "eval_1") and s.delete_eval("alice", "eval_1")
        assert s.get_eval_run("alice", "eval_1", "evalrun_1") is None and s.eval_items_done("evalrun_1") == []
        shared = s.share_model("alice", "ft:m::ftjob-1", "bob")
        assert shared["object"] == "checkpoint.permission" and shared["project_id"] == "bob"
        assert s.share_model("alice", "ft:m::ftjob-1", "bob") == shared  # once per tenant
        assert s.sharer("ft:m::ftjob-1", "bob") == "alice" and s.sharer("ft:m::ftjob-1", "carol") is None
        assert s.shared_with("bob") == [("ft:m::ftjob-1", "alice", shared["created_at"])]
        assert s.model_permissions("ft:m::ftjob-1") == [shared]
        assert not s.unshare_model("ft:other", shared["id"]) and s.unshare_model("ft:m::ftjob-1", shared["id"])
        assert s.sharer("ft:m::ftjob-1", "bob") is None and s.model_permissions("ft:m::ftjob-1") == []
        for i, (model, tag) in enumerate([("a", "x"), ("b", "x"), ("a", "y")]):
            s.add_chat_completion("alice", {"id": f"chatcmpl-{i}", "created": i, "model": model,
                                            "metadata": {"tag": tag}}, [{"role": "user", "content": str(i)}])
        assert [c["id"] for c in s.list_chat_completions("alice")[0]] == ["chatcmpl-0", "chatcmpl-1", "chatcmpl-2"]
        assert [c["id"] for c in s.list_chat_completions("alice", model="a", metadata={"tag": "y"})[0]] == \
            ["chatcmpl-2"]
        assert s.list_chat_completions("alice", after="chatcmpl-2", ascending=False, limit=1) == (
            [s.get_chat_completion("alice", "chatcmpl-1")[0]], True)
        assert s.get_chat_completion("bob", "chatcmpl-0") is None and s.list_chat_completions("bob") == ([], False)
        assert s.update_chat_completion("alice", "chatcmpl-0", {"tag": "z"})["metadata"] == {"tag": "z"}
        assert s.get_chat_completion("alice", "chatcmpl-0")[1] == [{"role": "user", "content": "0"}]
        assert s.update_chat_completion("bob", "chatcmpl-0", {}) is None
        assert not s.delete_chat_completion("bob", "chatcmpl-0") and s.delete_chat_completion("alice", "chatcmpl-0")
        s.add_response("alice", {"id": "resp_bg", "created_at": 1, "status": "queued"}, [])
        assert s.replace_response("alice", {"id": "resp_bg", "created_at": 1, "status": "in_progress"}, [{"x": 1}])
        assert not s.replace_response("bob", {"id": "resp_bg", "status": "completed"}, [])
        assert s.end_unfinished_responses({"code": "server_error"}) == ["resp_bg"]
        assert s.get_response("alice", "resp_bg") == ({"id": "resp_bg", "created_at": 1, "status": "failed",
                                                       "error": {"code": "server_error"}}, [{"x": 1}])
        assert s.end_unfinished_responses({}) == []
        conv = {"id": "conv_1", "object": "conversation", "created_at": 3, "metadata": {}}
        s.add_conversation("alice", conv, [{"id": "msg_1", "type": "message"}])
        assert s.add_conversation_items("alice", "conv_1", [{"id": "msg_2", "type": "message"}])
        assert not s.add_conversation_items("bob", "conv_1", [{"id": "msg_3", "type": "message"}])
        assert [i["id"] for i in s.conversation_items("alice", "conv_1")] == ["msg_1", "msg_2"]
        assert s.conversation_items("bob", "conv_1") is None and s.get_conversation("bob", "conv_1") is None
        assert s.update_conversation("alice", "conv_1", {"k": "v"})["metadata"] == {"k": "v"}
        assert not s.delete_conversation_item("bob", "conv_1", "msg_1")
        assert s.delete_conversation_item("alice", "conv_1", "msg_1")
        assert not s.delete_conversation("bob", "conv_1") and s.delete_conversation("alice", "conv_1")
        assert s._conn.execute("SELECT COUNT(*) FROM conversation_items").fetchone()[0] == 0
    finally:
        s.close()


def test_upload_parts_are_kept_until_the_upload_leaves_pending(store):
    upload_id = Store.new_id("upload")
    store.add_upload("alice", {"id": upload_id, "status": "pending", "created_at": 1, "bytes": 10})
    a = store.add_upload_part(upload_id, b"hello", limit=10)
    b = store.add_upload_part(upload_id, b"world", limit=10)
    assert a["object"] == "upload.part" and a["upload_id"] == upload_id
    assert store.upload_parts(upload_id) == {a["id"]: 5, b["id"]: 5}
    assert (store.upload_dir(upload_id) / b["id"]).read_bytes() == b"world"
    with pytest.raises(ValueError, match="^data: the parts would hold 11 bytes"):
        store.add_upload_part(upload_id, b"!", limit=10)
    assert len(list(store.upload_dir(upload_id).iterdir())) == 2  # the refused part's bytes are gone
    assert store.get_upload("bob", upload_id) is None and store.get_upload(None, upload_id)["bytes"] == 10
    assert [u["id"] for u in store.uploads_with_status("pending")] == [upload_id]
    assert store.update_upload(upload_id, "completed", status="cancelled") is None  # not in that status
    assert store.update_upload(upload_id, "pending", status="cancelled")["status"] == "cancelled"
    assert store.upload_parts(upload_id) == {} and not store.upload_dir(upload_id).exists()
    assert store.add_upload_part(upload_id, b"late", limit=10) is None  # no longer pending
    assert not store.upload_dir(upload_id).exists() or not any(store.upload_dir(upload_id).iterdir())
    with pytest.raises(ValueError, match="^upload_id: '../x' is not an upload id"):
        store.upload_dir("../x")


def test_tenants(store):
    store.ensure_tenant("alice")
    store.ensure_tenant("bob")
    store.ensure_tenant("alice")
    assert store.tenants() == ["alice", "bob"]
    with pytest.raises(ValueError, match="tenant"):
        store.ensure_tenant("")


# ---- files

def test_file_roundtrip(store):
    data = b'{"prompt": "a", "completion": "b"}\n'
    f = store.add_file("alice", "train.jsonl", "fine-tune", data)
    assert f["object"] == "file" and f["bytes"] == len(data) and f["status"] == "processed"
    assert f["id"].startswith("file-") and len(f["id"]) == 5 + 24
    assert f["filename"] == "train.jsonl" and f["purpose"] == "fine-tune"
    assert f["status_details"] is None
    assert store.file_path(f["id"]).read_bytes() == data
    assert store.get_file("alice", f["id"]) == f
    assert "alice" in store.tenants()
    assert list(store.files_dir.iterdir()) == [store.file_path(f["id"])]  # no temp left


def test_list_files_newest_first_and_by_purpose(store):
    a = store.add_file("alice", "a", "fine-tune", b"1")
    b = store.add_file("alice", "b", "batch", b"2")
    c = store.add_file("alice", "c", "fine-tune", b"3")
    assert [f["id"] for f in store.list_files("alice")] == [c["id"], b["id"], a["id"]]
    assert [f["id"] for f in store.list_files("alice", "fine-tune")] == [c["id"], a["id"]]


def test_delete_file(store):
    f = store.add_file("alice", "x.jsonl", "fine-tune", b"x")
    assert store.delete_file("alice", f["id"]) is True
    assert not store.file_path(f["id"]).exists()
    assert store.get_file("alice", f["id"]) is None
    assert store.delete_file("alice", f["id"]) is False


def test_files_are_isolated_between_tenants(store):
    f = store.add_file("alice", "x.jsonl", "fine-tune", b"x")
    assert store.get_file("bob", f["id"]) is None
    assert store.list_files("bob") == []
    assert store.delete_file("bob", f["id"]) is False
    assert store.get_file("alice", f["id"]) == f
    assert store.file_path(f["id"]).exists()


def test_filename_is_only_metadata(store):
    f = store.add_file("alice", "../../etc/passwd", "fine-tune", b"x")
    assert store.file_path(f["id"]).parent == store.files_dir
    assert store.get_file("alice", f["id"])["filename"] == "../../etc/passwd"


@pytest.mark.parametrize("bad", ["../x", "file-../../etc/passwd", "file-" + "A" * 24,
                                 "file-" + "0" * 23, "file-" + "0" * 24 + "\n", "", None])
def test_file_path_rejects_non_ids(store, bad):
    with pytest.raises(ValueError, match="file_id"):
        store.file_path(bad)


def test_add_file_rejects_non_bytes(store):
    with pytest.raises(ValueError, match="data"):
        store.add_file("alice", "x", "fine-tune", "text")


# ---- jobs

def test_job_add_update_get(store):
    job = _job()
    assert store.add_job("alice", job) == job
    assert store.get_job("alice", job["id"]) == job
    assert store.get_job("bob", job["id"]) is None
    assert store.get_job(None, job["id"]) == job
    assert store.job_tenant(job["id"]) == "alice"
    assert store.job_tenant("ftjob-none") is None
    new = store.update_job(job["id"], status="running", trained_tokens=5)
    assert new == {**job, "status": "running", "trained_tokens": 5}
    assert store.get_job("alice", job["id"]) == new
    assert store.count_jobs("running") == 1 and store.count_jobs("queued") == 0
    got = store.get_job("alice", job["id"])
    got["status"] = "mutated"  # callers get fresh dicts
    assert store.get_job("alice", job["id"])["status"] == "running"


def test_job_errors_name_the_field(store):
    job = store.add_job("alice", _job())
    with pytest.raises(KeyError, match="job_id"):
        store.update_job("ftjob-missing", status="running")
    with pytest.raises(ValueError, match="job.id"):
        store.add_job("alice", dict(job))
    with pytest.raises(ValueError, match="job.status"):
        store.add_job("alice", {"id": Store.new_id("ftjob")})
    with pytest.raises(ValueError, match="id"):
        store.update_job(job["id"], id="ftjob-other")


def test_list_jobs_pagination(store):
    ids = [store.add_job("alice", _job())["id"] for _ in range(5)]
    store.add_job("bob", _job())
    newest = ids[::-1]
    page, more = store.list_jobs("alice", limit=2)
    assert [j["id"] for j in page] == newest[:2] and more
    page, more = store.list_jobs("alice", after=page[-1]["id"], limit=2)
    assert [j["id"] for j in page] == newest[2:4] and more
    page, more = store.list_jobs("alice", after=page[-1]["id"], limit=2)
    assert [j["id"] for j in page] == newest[4:] and not more
    page, more = store.list_jobs("alice")
    assert [j["id"] for j in page] == newest and not more


def test_list_jobs_filters_by_metadata_as_openai_does(store):
    a = store.add_job("alice", _job(metadata={"team": "red", "run": "1"}))["id"]
    b = store.add_job("alice", _job(metadata={"team": "blue", "my key": ""}))["id"]
    c = store.add_job("alice", _job(metadata=None))["id"]
    store.add_job("bob", _job(metadata={"team": "red"}))

    def ids(**kw):
        return [j["id"] for j in store.list_jobs("alice", **kw)[0]]
    assert ids() == [c, b, a]
    assert ids(metadata={"team": "red"}) == [a] and ids(metadata={"team": "red", "run": "2"}) == []
    assert ids(metadata={"my key": ""}) == [b]  # an empty value filters for that key with an empty value
    assert ids(without_metadata=True) == [c]
    page, more = store.list_jobs("alice", metadata={"team": "blue"}, limit=1)
    assert [j["id"] for j in page] == [b] and not more
    with pytest.raises(ValueError, match="^metadata: the key"):
        ids(metadata={'a"b': "x"})


def test_list_jobs_bad_cursor_and_limit(store):
    bob_job = store.add_job("bob", _job())
    with pytest.raises(ValueError, match="after"):
        store.list_jobs("alice", after="ftjob-x")
    with pytest.raises(ValueError, match="after"):
        store.list_jobs("alice", after=bob_job["id"])  # another tenant's job
    with pytest.raises(ValueError, match="limit"):
        store.list_jobs("bob", limit=0)


def test_jobs_with_status_and_count(store):
    a = store.add_job("alice", _job("queued"))
    b = store.add_job("bob", _job("running"))
    c = store.add_job("alice", _job("queued"))
    store.add_job("bob", _job("succeeded"))
    got = store.jobs_with_status("queued", "running")
    assert [(t, j["id"]) for t, j in got] == [("alice", a["id"]), ("bob", b["id"]),
                                              ("alice", c["id"])]
    assert store.jobs_with_status("failed") == []
    assert store.count_jobs("queued", "running") == 3
    assert store.count_jobs("queued", tenant="alice") == 2
    assert store.count_jobs("queued", tenant="bob") == 0
    assert store.count_jobs() == 4
    assert store.count_jobs(tenant="bob") == 2


# ---- events

def test_events_order_and_pagination(store):
    job = store.add_job("alice", _job())
    events = [store.add_event(job["id"], f"m{i}") for i in range(5)]
    e = events[0]
    assert e["object"] == "fine_tuning.job.event" and e["id"].startswith("ftevent-")
    assert e["level"] == "info" and e["type"] == "message" and e["data"] == {}
    newest = [e["id"] for e in events[::-1]]
    page, more = store.list_events(job["id"], limit=2)
    assert [e["id"] for e in page] == newest[:2] and more
    page, more = store.list_events(job["id"], after=page[-1]["id"], limit=3)
    assert [e["id"] for e in page] == newest[2:] and not more
    with pytest.raises(ValueError, match="after"):
        store.list_events(job["id"], after="ftevent-x")
    with pytest.raises(KeyError, match="job_id"):
        store.add_event("ftjob-missing", "hi")


def test_events_of_other_jobs_are_separate(store):
    j1, j2 = store.add_job("alice", _job()), store.add_job("alice", _job())
    e1 = store.add_event(j1["id"], "one")
    store.add_event(j2["id"], "two")
    assert [e["message"] for e in store.list_events(j1["id"])[0]] == ["one"]
    with pytest.raises(ValueError, match="after"):
        store.list_events(j2["id"], after=e1["id"])


def test_has_step_event(store):
    job = store.add_job("alice", _job())
    store.add_event(job["id"], "step 3", type="metrics", data={"step": 3, "train_loss": 1.5})
    store.add_event(job["id"], "note", data={"step": 4})  # not a metrics event
    assert store.has_step_event(job["id"], 3)
    assert not store.has_step_event(job["id"], 4)
    assert not store.has_step_event("ftjob-other", 3)


# ---- checkpoints

def test_checkpoints(store):
    job = store.add_job("alice", _job())
    jid = job["id"]
    assert store.latest_checkpoint(jid) is None
    c1 = store.add_checkpoint(jid, 10, "/ck/10", f"ft:tiny:{jid}:ckpt-step-10", {"loss": 2.0})
    assert c1["object"] == "fine_tuning.job.checkpoint" and c1["step_number"] == 10
    assert c1["fine_tuning_job_id"] == jid and "path" not in c1
    store.add_checkpoint(jid, 20, "/ck/20", f"ft:tiny:{jid}:ckpt-step-20", {"loss": 1.0})
    c3 = store.add_checkpoint(jid, 30, "/ck/30", f"ft:tiny:{jid}:ckpt-step-30", {"loss": 0.5})
    assert store.latest_checkpoint(jid) == (c3, "/ck/30")
    page, more = store.list_checkpoints(jid, limit=2)
    assert [c["step_number"] for c in page] == [30, 20] and more
    page, more = store.list_checkpoints(jid, after=page[-1]["id"])
    assert [c["step_number"] for c in page] == [10] and not more
    assert store.checkpoint_by_model(f"ft:tiny:{jid}:ckpt-step-20") == (jid, "/ck/20")
    assert store.checkpoint_by_model("ft:nothing") is None
    with pytest.raises(ValueError, match="after"):
        store.list_checkpoints(jid, after="ftckpt-x")


def test_checkpoint_same_step_replaces(store):
    jid = store.add_job("alice", _job())["id"]
    store.add_checkpoint(jid, 10, "/old", "ft:old", {"loss": 2.0})
    new = store.add_checkpoint(jid, 10, "/new", "ft:new", {"loss": 1.0})
    page, _ = store.list_checkpoints(jid)
    assert page == [new]
    assert store.latest_checkpoint(jid) == (new, "/new")
    assert store.checkpoint_by_model("ft:old") is None


# ---- threads, reopen, durability

def test_concurrent_add_event(store):
    jid = store.add_job("alice", _job())["id"]
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            barrier.wait()
            for i in range(50):
                store.add_event(jid, f"t{t}-{i}")
                store.list_events(jid, limit=1)
        except BaseException as e:  # surfaced below: threads swallow exceptions
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    page, more = store.list_events(jid, limit=1000)
    assert len(page) == 200 and not more
    assert {e["message"] for e in page} == {f"t{t}-{i}" for t in range(4) for i in range(50)}


def test_reopen_sees_data(tmp_path):
    s = Store(tmp_path)
    f = s.add_file("alice", "x", "fine-tune", b"abc")
    job = s.add_job("alice", _job())
    s.update_job(job["id"], status="running")
    s.close()
    s2 = Store(tmp_path)
    try:
        assert s2.get_file("alice", f["id"]) == f
        assert s2.get_job("alice", job["id"])["status"] == "running"
        assert s2.tenants() == ["alice"]
    finally:
        s2.close()


def test_state_survives_sigkill(tmp_path):
    script = textwrap.dedent("""
        import os, signal, sys
        from coserve.server.store import Store
        s = Store(sys.argv[1])
        f = s.add_file("alice", "t.jsonl", "fine-tune", b"data\\n")
        jid = Store.new_id("ftjob")
        s.add_job("alice", {"id": jid, "status": "queued", "created_at": 1})
        s.update_job(jid, status="running")
        s.add_event(jid, "started")
        s.add_event(jid, "step 1", type="metrics", data={"step": 1})
        s.add_checkpoint(jid, 1, "/ck/1", "ft:m:ckpt-step-1", {"loss": 1.0})
        print(f["id"], jid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert proc.returncode == -9, proc.stderr
    file_id, jid = proc.stdout.split()
    s = Store(tmp_path)
    try:
        assert s.get_file("alice", file_id)["bytes"] == 5
        assert s.file_path(file_id).read_bytes() == b"data\n"
        assert s.get_job("alice", jid)["status"] == "running"
        assert [e["message"] for e in s.list_events(jid)[0]] == ["step 1", "started"]
        assert s.has_step_event(jid, 1)
        assert s.latest_checkpoint(jid)[1] == "/ck/1"
        assert s.checkpoint_by_model("ft:m:ckpt-step-1") == (jid, "/ck/1")
    finally:
        s.close()
