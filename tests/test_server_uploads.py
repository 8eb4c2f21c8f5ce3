"""OpenAI's Uploads API on a live server through the official ``openai`` client: a training file sent in parts
becomes one file (the same bytes) that a fine-tuning job takes; every bad request is a 4xx naming the field; another
tenant's upload is a 404. (That parts survive a SIGKILL is checked in ``test_server_restart.py``.)"""

from __future__ import annotations

import hashlib
import io
import json
import time

import httpx
import openai
import pytest
from openai import OpenAI

from server_helpers import API_FILE_BYTES, API_KEYS, API_PART_BYTES, chat_jsonl

ALICE, BOB = API_KEYS["alice"], API_KEYS["bob"]
BASE = "tiny-llama"
PART, FILE = API_PART_BYTES, API_FILE_BYTES  # the server's --max-upload-bytes and --max-file-bytes


def _client(srv, key: str) -> OpenAI:
    return OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


def _training_file() -> bytes:
    data = chat_jsonl() * 12  # larger than one request may carry
    assert PART < len(data) < FILE
    return data


def _open(client, data: bytes, **kwargs):
    return client.uploads.create(**{"bytes": len(data), "filename": "train.jsonl", "mime_type": "application/jsonl",
                                    "purpose": "fine-tune", **kwargs})


def test_a_file_sent_in_parts_is_one_file_a_job_takes(server):
    alice = _client(server, ALICE)
    data = _training_file()
    with pytest.raises(openai.APIStatusError) as e:  # too large for one request
        alice.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune")
    assert e.value.status_code == 413
    upload = alice.uploads.upload_file_chunked(file=data, filename="train.jsonl", bytes=len(data),
                                               mime_type="application/jsonl", purpose="fine-tune", part_size=1000,
                                               md5=hashlib.md5(data).hexdigest())
    assert upload.status == "completed" and upload.bytes == len(data) and upload.object == "upload"
    assert upload.file.bytes == len(data) and upload.file.purpose == "fine-tune"
    assert upload.file.filename == "train.jsonl" and upload.file.id.endswith(upload.id.removeprefix("upload-"))
    assert alice.files.content(upload.file.id).read() == data
    assert upload.file.id in [f.id for f in alice.files.list().data]
    job = alice.fine_tuning.jobs.create(model=BASE, training_file=upload.file.id)
    assert alice.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    # a completed upload takes no more parts and does not complete again
    with pytest.raises(openai.ConflictError):
        alice.uploads.parts.create(upload.id, data=b"{}\n")
    with pytest.raises(openai.ConflictError) as e:
        alice.uploads.complete(upload.id, part_ids=["part-x"])
    assert e.value.body["code"] == "upload_not_pending"


def test_bad_uploads_are_4xx_naming_the_field(server):
    alice, bob = _client(server, ALICE), _client(server, BOB)
    data = _training_file()
    for kwargs, status, param in [({"purpose": "assistants"}, 400, "purpose"),
                                  ({"mime_type": "application/pdf"}, 400, "mime_type"),
                                  ({"bytes": FILE + 1}, 413, "bytes"),
                                  ({"bytes": 0}, 400, "bytes"),
                                  ({"expires_after": {"anchor": "created_at", "seconds": 3600}}, 400, "expires_after")]:
        with pytest.raises(openai.APIStatusError) as e:
            _open(alice, data, **kwargs)
        assert (e.value.status_code, e.value.body.get("param")) == (status, param), e.value.body
    upload = _open(alice, data)
    with pytest.raises(openai.APIStatusError) as e:  # a part over --max-upload-bytes
        alice.uploads.parts.create(upload.id, data=data[:PART + 1])
    assert e.value.status_code == 413
    parts = [alice.uploads.parts.create(upload.id, data=data[i:i + 2000]).id for i in range(0, len(data), 2000)]
    with pytest.raises(openai.BadRequestError) as e:  # more bytes than the upload was created for
        alice.uploads.parts.create(upload.id, data=b"x")
    assert e.value.body["param"] == "data"
    for part_ids, md5, param in [(["part-" + "0" * 24, *parts[1:]], None, "part_ids[0]"),
                                 ([parts[0], parts[0], *parts[1:]], None, "part_ids[1]"),
                                 (parts[:-1], None, "part_ids"),
                                 (parts, hashlib.md5(b"other").hexdigest(), "md5"),
                                 (list(reversed(parts)), None, "part_ids")]:  # out of order: not JSONL
        with pytest.raises(openai.BadRequestError) as e:
            alice.uploads.complete(upload.id, part_ids=part_ids, **({"md5": md5} if md5 else {}))
        assert e.value.body["param"] == param, e.value.body
    assert "line" in e.value.body["message"]  # the bad line is named
    # bob cannot touch alice's upload
    for call in (lambda: bob.uploads.parts.create(upload.id, data=b"x"),
                 lambda: bob.uploads.complete(upload.id, part_ids=parts),
                 lambda: bob.uploads.cancel(upload.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.uploads.complete(upload.id, part_ids=parts).status == "completed"  # still whole
    other = _open(alice, data)
    assert alice.uploads.cancel(other.id).status == "cancelled"
    for call in (lambda: alice.uploads.parts.create(other.id, data=b"x"), lambda: alice.uploads.cancel(other.id)):
        with pytest.raises(openai.ConflictError):
            call()
    bad = b'{"messages": [{"role": "robot", "content": "hi"}]}\n'  # no such role
    upload = _open(alice, bad)
    part = alice.uploads.parts.create(upload.id, data=bad)
    with pytest.raises(openai.BadRequestError) as e:
        alice.uploads.complete(upload.id, part_ids=[part.id])
    assert e.value.body["code"] == "invalid_file" and "line 1" in e.value.body["message"]
    r = httpx.post(f"{server.url}/v1/uploads/{upload.id}/parts", headers={"Authorization": f"Bearer {ALICE}"},
                   content=b"raw bytes")
    assert r.status_code == 400 and r.json()["error"]["param"] == "data"


def test_pending_uploads_expire_after_an_hour_and_drop_their_parts(tmp_path):
    from coserve.server.store import Store
    from coserve.server.uploads_api import EXPIRES_S, expire_overdue
    store = Store(tmp_path)
    try:
        now = int(time.time())
        for name, created in (("old", now - EXPIRES_S - 1), ("new", now)):
            store.add_upload("alice", {"id": Store.new_id("upload"), "filename": name, "status": "pending",
                                       "created_at": created, "expires_at": created + EXPIRES_S, "bytes": 4})
        old, new = store.uploads_with_status("pending")
        store.add_upload_part(old["id"], b"{}\n", limit=4)
        assert expire_overdue(store, now) == 1
        assert store.get_upload("alice", old["id"])["status"] == "expired"
        assert store.upload_parts(old["id"]) == {} and not store.upload_dir(old["id"]).exists()
        assert [u["id"] for u in store.uploads_with_status("pending")] == [new["id"]]
        assert json.loads(json.dumps(store.get_upload(None, new["id"])))["status"] == "pending"
    finally:
        store.close()
