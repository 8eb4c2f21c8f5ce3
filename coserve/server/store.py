"""The server's durable state: tenants, files, fine-tuning jobs, events, checkpoints, stored responses, batches,
evals and their runs, which fine-tuned models are shared with which tenants, and stored chat completions.

Everything lives under one state directory: ``state.db`` (SQLite, WAL journal,
``synchronous=FULL``, so every committed write survives the process being
killed), ``files/<file-id>.jsonl`` (the bytes of uploaded files, written
atomically before their row is inserted) and ``uploads/<upload-id>/<part-id>``
(the parts of a pending upload, the same way). Objects cross the boundary as plain
OpenAI-shaped dicts; each call returns fresh dicts the caller may mutate.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

SCHEMA_VERSION = 8  # 2: stored responses (the Responses API's previous_response_id); 3: batches; 4: uploads; 5: evals;
#   6: fine-tuned models shared with other tenants (checkpoint permissions); 7: stored chat completions;
#   8: conversations (the Conversations API) and their items
_FILE_ID = re.compile(r"file-[0-9a-f]{24}")
_UPLOAD_ID = re.compile(r"upload-[0-9a-f]{24}")

_SCHEMA = """
CREATE TABLE tenants (name TEXT PRIMARY KEY, created_at INTEGER NOT NULL);
CREATE TABLE files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name), filename TEXT NOT NULL,
    purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE INDEX files_tenant ON files(tenant, seq);
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name), status TEXT NOT NULL,
    created_at INTEGER NOT NULL, obj TEXT NOT NULL);
CREATE INDEX jobs_tenant ON jobs(tenant, seq);
CREATE INDEX jobs_status ON jobs(status, seq);
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL REFERENCES jobs(id), step INTEGER, obj TEXT NOT NULL);
CREATE INDEX events_job ON events(job_id, seq);
CREATE INDEX events_step ON events(job_id, step);
CREATE TABLE checkpoints (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL REFERENCES jobs(id), step INTEGER NOT NULL,
    path TEXT NOT NULL, model TEXT NOT NULL, obj TEXT NOT NULL,
    UNIQUE (job_id, step));
CREATE INDEX checkpoints_model ON checkpoints(model);
"""
# What each version adds to the one before (a state directory of an older server is brought up to date).
_MIGRATIONS = {2: """
CREATE TABLE responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name), created_at INTEGER NOT NULL,
    obj TEXT NOT NULL, conversation TEXT NOT NULL);
""", 3: """
CREATE TABLE batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name), status TEXT NOT NULL,
    created_at INTEGER NOT NULL, obj TEXT NOT NULL);
CREATE INDEX batches_tenant ON batches(tenant, seq);
""", 4: """
CREATE TABLE uploads (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name), status TEXT NOT NULL,
    created_at INTEGER NOT NULL, obj TEXT NOT NULL);
CREATE INDEX uploads_status ON uploads(status, seq);
CREATE TABLE upload_parts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    upload_id TEXT NOT NULL REFERENCES uploads(id), bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE INDEX upload_parts_upload ON upload_parts(upload_id, seq);
""", 5: """
CREATE TABLE evals (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name), status TEXT NOT NULL,
    created_at INTEGER NOT NULL, obj TEXT NOT NULL);
CREATE INDEX evals_tenant ON evals(tenant, seq);
CREATE TABLE eval_runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name), status TEXT NOT NULL,
    created_at INTEGER NOT NULL, obj TEXT NOT NULL,
    eval_id TEXT NOT NULL REFERENCES evals(id));
CREATE INDEX eval_runs_eval ON eval_runs(eval_id, seq);
CREATE INDEX eval_runs_status ON eval_runs(status, seq);
CREATE TABLE eval_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    run_id TEXT NOT NULL REFERENCES eval_runs(id), item INTEGER NOT NULL, status TEXT NOT NULL,
    obj TEXT NOT NULL, UNIQUE (run_id, item));
""", 6: """
CREATE TABLE permissions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, model TEXT NOT NULL,
    owner TEXT NOT NULL REFERENCES tenants(name), tenant TEXT NOT NULL, created_at INTEGER NOT NULL,
    UNIQUE (model, tenant));
CREATE INDEX permissions_tenant ON permissions(tenant, seq);
""", 7: """
CREATE TABLE chat_completions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name), created_at INTEGER NOT NULL,
    obj TEXT NOT NULL, messages TEXT NOT NULL);
CREATE INDEX chat_completions_tenant ON chat_completions(tenant, seq);
""", 8: """
CREATE TABLE conversations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name), created_at INTEGER NOT NULL, obj TEXT NOT NULL);
CREATE TABLE conversation_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL, conversation TEXT NOT NULL, obj TEXT NOT NULL,
    UNIQUE (conversation, id));
CREATE INDEX conversation_items_seq ON conversation_items(conversation, seq);
"""}


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all (a temporary file beside it, synced, renamed, the rename synced)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _now() -> int:
    return int(time.time())


def _permission(row: tuple) -> dict:
    """OpenAI's ``checkpoint.permission`` object from ``(id, created_at, tenant)``: the tenant is its project."""
    return {"id": row[0], "object": "checkpoint.permission", "created_at": row[1], "project_id": row[2]}


def _metadata_where(where: str, params: list, metadata: dict[str, str] | None) -> tuple[str, list]:
    """``where``/``params`` narrowed to objects whose metadata holds every pair of ``metadata`` (OpenAI's filter);
    ValueError for a key SQLite's JSON path cannot hold."""
    for key, value in (metadata or {}).items():
        if '"' in key or "\\" in key:
            raise ValueError(f"metadata: the key {key!r} has a quote or a backslash")
        where += " AND json_extract(obj, ?) = ?"
        params = [*params, f'$.metadata."{key}"', value]
    return where, params


def _created_where(where: str, params: list, created: tuple[int | None, int | None]) -> tuple[str, list]:
    """``where``/``params`` narrowed to rows created within ``created`` (its bounds included, where given)."""
    for bound, op in zip(created, (">=", "<=")):
        if bound is not None:
            where += f" AND created_at {op} ?"
            params = [*params, bound]
    return where, params


def _in(statuses: tuple[str, ...]) -> tuple[str, list[str]]:
    """A ``status IN (...)`` clause (placeholders only) or none when no statuses."""
    if not statuses:
        return "1", []
    return f"status IN ({','.join('?' * len(statuses))})", list(statuses)


class Store:
    """SQLite-backed state of the server; every public method is thread-safe."""

    def __init__(self, state_dir: Path | str) -> None:
        self.state_dir = Path(state_dir)
        self.files_dir = self.state_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.uploads_dir = self.state_dir / "uploads"
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(self.state_dir / "state.db", check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._create_schema()

    def _create_schema(self) -> None:
        (version,) = self._conn.execute("PRAGMA user_version").fetchone()
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise ValueError(f"state_dir: state.db has schema version {version}, "
                             f"this server knows {SCHEMA_VERSION}")
        # executescript commits first; BEGIN..COMMIT makes each step and its version one transaction.
        if version == 0:
            self._conn.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = 1; COMMIT;")
        for step in range(max(version, 1) + 1, SCHEMA_VERSION + 1):
            self._conn.executescript(f"BEGIN; {_MIGRATIONS[step]} PRAGMA user_version = {step}; COMMIT;")

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._conn.close()

    def _one(self, sql: str, params: tuple | list = ()) -> tuple | None:
        with self._lock:
            return self._conn.execute(sql, params).fetchone()

    def _all(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    # ---- tenants

    def _insert_tenant(self, tenant: str) -> None:
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant: must be a non-empty string, got {tenant!r}")
        self._conn.execute("INSERT OR IGNORE INTO tenants VALUES (?, ?)", (tenant, _now()))

    def _insert_object(self, table: str, tenant: str, obj: dict) -> None:
        """A tenant's object row in ``table`` (jobs, batches, uploads: id, status, created_at and the JSON), its
        tenant recorded; the caller holds the lock and the transaction."""
        self._insert_tenant(tenant)
        self._conn.execute(f"INSERT INTO {table} (id, tenant, status, created_at, obj) VALUES (?, ?, ?, ?, ?)",
                           (obj["id"], tenant, obj["status"], obj["created_at"], json.dumps(obj)))

    def ensure_tenant(self, tenant: str) -> None:
        """Record ``tenant`` if it is not recorded yet."""
        with self._lock, self._conn:
            self._insert_tenant(tenant)

    def tenants(self) -> list[str]:
        """Every tenant ever seen, oldest first."""
        return [name for (name,) in self._all("SELECT name FROM tenants ORDER BY rowid")]

    # ---- files

    @staticmethod
    def new_id(prefix: str) -> str:
        """A fresh id such as ``ftjob-<24 hex>``."""
        return f"{prefix}-{secrets.token_hex(12)}"

    def file_path(self, file_id: str) -> Path:
        """Where the bytes of ``file_id`` live; ValueError unless it is a file id."""
        if not isinstance(file_id, str) or not _FILE_ID.fullmatch(file_id):
            raise ValueError(f"file_id: {file_id!r} is not a file id (file-<24 hex>)")
        return self.files_dir / f"{file_id}.jsonl"

    def add_file(self, tenant: str, filename: str, purpose: str, data: bytes, file_id: str | None = None) -> dict:
        """Store an uploaded file (bytes first, then the row); returns the file object. With ``file_id`` (one the
        server derives, for a file it writes: a batch's output) the call is idempotent: where that file already
        exists it is returned as it is, so a write that a crash interrupted can be done again without a copy."""
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"data: must be bytes, got {type(data).__name__}")
        if file_id is None:
            file_id = self.new_id("file")
        else:
            existing = self.get_file(tenant, file_id)
            if existing is not None:
                return existing
        path = self.file_path(file_id)
        write_atomically(path, bytes(data))
        row = (file_id, tenant, str(filename), str(purpose), len(data), _now())
        try:
            with self._lock, self._conn:
                self._insert_tenant(tenant)
                self._conn.execute("INSERT INTO files (id, tenant, filename, purpose, bytes,"
                                   " created_at) VALUES (?, ?, ?, ?, ?, ?)", row)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return _file_object(row)

    def get_file(self, tenant: str, file_id: str) -> dict | None:
        """The file object, or None when absent or owned by another tenant."""
        row = self._one(f"SELECT {_FILE_COLS} FROM files WHERE id = ? AND tenant = ?",
                        (file_id, tenant))
        return None if row is None else _file_object(row)

    def list_files(self, tenant: str, purpose: str | None = None) -> list[dict]:
        """The tenant's files, newest first, optionally only those with ``purpose``."""
        sql = f"SELECT {_FILE_COLS} FROM files WHERE tenant = ?"
        params: list = [tenant]
        if purpose is not None:
            sql += " AND purpose = ?"
            params.append(purpose)
        return [_file_object(r) for r in self._all(sql + " ORDER BY seq DESC", params)]

    def delete_file(self, tenant: str, file_id: str) -> bool:
        """Remove the row and the bytes; False when absent or another tenant's."""
        with self._lock, self._conn:
            cur = self._conn.execute("DELETE FROM files WHERE id = ? AND tenant = ?",
                                     (file_id, tenant))
        if cur.rowcount == 0:
            return False
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    # ---- fine-tuned models shared with other tenants (OpenAI's checkpoint permissions)

    def share_model(self, owner: str, model: str, tenant: str) -> dict:
        """``tenant`` may use ``owner``'s fine-tuned model or checkpoint ``model``: its permission object (the one
        already there when it was shared before)."""
        with self._lock, self._conn:
            self._insert_tenant(owner)
            self._conn.execute("INSERT OR IGNORE INTO permissions (id, model, owner, tenant, created_at)"
                               " VALUES (?, ?, ?, ?, ?)", (f"cp_{secrets.token_hex(12)}", model, owner, tenant, _now()))
            row = self._conn.execute("SELECT id, created_at, tenant FROM permissions WHERE model = ? AND tenant = ?",
                                     (model, tenant)).fetchone()
        return _permission(row)

    def model_permissions(self, model: str) -> list[dict]:
        """The permissions of ``model``, oldest first."""
        return [_permission(r) for r in self._all("SELECT id, created_at, tenant FROM permissions WHERE model = ?"
                                                  " ORDER BY seq", (model,))]

    def unshare_model(self, model: str, permission_id: str) -> bool:
        with self._lock, self._conn:
            cur = self._conn.execute("DELETE FROM permissions WHERE model = ? AND id = ?", (model, permission_id))
        return cur.rowcount > 0

    def sharer(self, model: str, tenant: str) -> str | None:
        """The tenant that shared ``model`` with ``tenant``, or None where it is not shared with it."""
        row = self._one("SELECT owner FROM permissions WHERE model = ? AND tenant = ?", (model, tenant))
        return None if row is None else row[0]

    def shared_with(self, tenant: str) -> list[tuple[str, str, int]]:
        """``(model, owner, shared at)`` of every model shared with ``tenant``, oldest first."""
        return [tuple(r) for r in self._all("SELECT model, owner, created_at FROM permissions WHERE tenant = ?"
                                            " ORDER BY seq", (tenant,))]

    # ---- stored chat completions (OpenAI's ``store: true``)

    def add_chat_completion(self, tenant: str, obj: dict, messages: list[dict]) -> None:
        """Keep a chat completion (with its ``metadata``) and the messages it answered."""
        with self._lock, self._conn:
            self._insert_tenant(tenant)
            self._conn.execute("INSERT INTO chat_completions (id, tenant, created_at, obj, messages)"
                               " VALUES (?, ?, ?, ?, ?)",
                               (obj["id"], tenant, obj["created"], json.dumps(obj), json.dumps(messages)))

    def get_chat_completion(self, tenant: str, completion_id: str) -> tuple[dict, list[dict]] | None:
        """The tenant's stored chat completion and the messages it answered, or None."""
        row = self._one("SELECT obj, messages FROM chat_completions WHERE id = ? AND tenant = ?",
                        (completion_id, tenant))
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def list_chat_completions(self, tenant: str, model: str | None = None, metadata: dict[str, str] | None = None,
                              after: str | None = None, limit: int = 20, ascending: bool = True,
                              created: tuple[int | None, int | None] = (None, None)) -> tuple[list[dict], bool]:
        """One page of the tenant's stored chat completions, oldest first (or newest), past ``after``: those of
        ``model``, whose metadata holds every pair of ``metadata``, and created within ``created`` (bounds
        included), where given."""
        where, params = _created_where("tenant = ?", [tenant], created)
        if model is not None:
            where += " AND json_extract(obj, '$.model') = ?"
            params.append(model)
        where, params = _metadata_where(where, params, metadata)
        return self._page("chat_completions", "seq", where, params, after, limit,
                          "a stored chat completion of this tenant", ascending)

    def chat_messages(self, tenant: str, completion_ids: list[str]) -> dict[str, list[dict]]:
        """The messages each of the tenant's stored completions ``completion_ids`` answered, by id (a query a 500)."""
        rows = []
        for at in range(0, len(completion_ids), 500):  # within SQLite's limit on a statement's parameters
            ids = completion_ids[at:at + 500]
            rows += self._all(f"SELECT id, messages FROM chat_completions WHERE tenant = ? AND id IN "
                              f"({','.join('?' * len(ids))})", [tenant, *ids])
        return {i: json.loads(m) for i, m in rows}

    def update_chat_completion(self, tenant: str, completion_id: str, metadata: dict[str, str] | None
                               ) -> dict | None:
        """Replace the stored completion's metadata (None: none); the updated object, or None if it has none."""
        return self._set_metadata("chat_completions", tenant, completion_id, metadata)

    def _set_metadata(self, table: str, tenant: str, ident: str, metadata: dict[str, str] | None) -> dict | None:
        """Replace the metadata of the tenant's object ``ident`` in ``table`` (a constant of this module); the
        updated object, or None if the tenant has none by that id."""
        with self._lock, self._conn:
            row = self._conn.execute(f"SELECT obj FROM {table} WHERE id = ? AND tenant = ?", (ident, tenant)).fetchone()
            if row is None:
                return None
            obj = {**json.loads(row[0]), "metadata": metadata}
            self._conn.execute(f"UPDATE {table} SET obj = ? WHERE id = ?", (json.dumps(obj), ident))
        return obj

    def delete_chat_completion(self, tenant: str, completion_id: str) -> bool:
        with self._lock, self._conn:
            cur = self._conn.execute("DELETE FROM chat_completions WHERE id = ? AND tenant = ?",
                                     (completion_id, tenant))
        return cur.rowcount > 0

    # ---- stored responses (the Responses API)

    def add_response(self, tenant: str, obj: dict, conversation: list[dict]) -> None:
        """Keep a finished response and the conversation up to and with its output."""
        with self._lock, self._conn:
            self._insert_tenant(tenant)
            self._conn.execute("INSERT INTO responses (id, tenant, created_at, obj, conversation)"
                               " VALUES (?, ?, ?, ?, ?)",
                               (obj["id"], tenant, obj.get("created_at", _now()), json.dumps(obj),
                                json.dumps(conversation)))

    def get_response(self, tenant: str, response_id: str) -> tuple[dict, list[dict]] | None:
        """The tenant's stored response and its conversation, or None."""
        row = self._one("SELECT obj, conversation FROM responses WHERE id = ? AND tenant = ?",
                        (response_id, tenant))
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def replace_response(self, tenant: str, obj: dict, conversation: list[dict]) -> bool:
        """A stored response's new state (a background response as it runs); False if the tenant has none by that
        id (it was deleted meanwhile)."""
        with self._lock, self._conn:
            cur = self._conn.execute("UPDATE responses SET obj = ?, conversation = ? WHERE id = ? AND tenant = ?",
                                     (json.dumps(obj), json.dumps(conversation), obj["id"], tenant))
        return cur.rowcount > 0

    def list_responses(self, tenant: str, model: str | None = None, metadata: dict[str, str] | None = None,
                       limit: int = 20, created: tuple[int | None, int | None] = (None, None),
                       instructions_search: str | None = None, temperature: float | None = None,
                       top_p: float | None = None, users: list[str] | None = None, tools: list[str] | None = None,
                       reasoning_effort: str | None = None) -> list[tuple[dict, list[dict]]]:
        """The tenant's finished stored responses (``completed`` or ``incomplete``), oldest first, each with its
        conversation: those of ``model``, whose metadata holds every pair of ``metadata``, created within
        ``created`` (bounds included), whose instructions contain ``instructions_search``, sampled at
        ``temperature`` and ``top_p``, made for one of ``users``, offered one of ``tools`` (by name), asked for
        ``reasoning_effort``, where given; at most ``limit``."""
        where, params = _created_where("tenant = ? AND json_extract(obj, '$.status') IN ('completed', 'incomplete')",
                                       [tenant], created)
        for path, value in (("$.model", model), ("$.temperature", temperature), ("$.top_p", top_p),
                            ("$.reasoning.effort", reasoning_effort)):
            if value is not None:
                where += " AND json_extract(obj, ?) = ?"
                params += [path, value]
        if instructions_search is not None:
            where += " AND instr(coalesce(json_extract(obj, '$.instructions'), ''), ?) > 0"
            params.append(instructions_search)
        if users is not None:
            where += f" AND json_extract(obj, '$.user') IN ({','.join('?' * len(users))})"
            params += users
        if tools is not None:
            where += (" AND EXISTS (SELECT 1 FROM json_each(obj, '$.tools') WHERE json_extract(value, '$.name') IN "
                      f"({','.join('?' * len(tools))}))")
            params += tools
        where, params = _metadata_where(where, params, metadata)
        rows = self._all(f"SELECT obj, conversation FROM responses WHERE {where} ORDER BY seq ASC LIMIT ?",
                         [*params, limit])
        return [(json.loads(obj), json.loads(conversation)) for obj, conversation in rows]

    def end_unfinished_responses(self, error: dict) -> list[str]:
        """Mark every stored response still queued or in progress (a background response a stopped server left)
        failed with ``error``; their ids."""
        with self._lock, self._conn:
            rows = self._conn.execute("SELECT id, obj FROM responses WHERE json_extract(obj, '$.status')"
                                      " IN ('queued', 'in_progress')").fetchall()
            for response_id, obj in rows:
                ended = {**json.loads(obj), "status": "failed", "error": error}
                self._conn.execute("UPDATE responses SET obj = ? WHERE id = ?", (json.dumps(ended), response_id))
        return [r[0] for r in rows]

    def delete_response(self, tenant: str, response_id: str) -> bool:
        with self._lock, self._conn:
            cur = self._conn.execute("DELETE FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant))
        return cur.rowcount > 0

    # ---- conversations (OpenAI's Conversations API) and their items

    def add_conversation(self, tenant: str, obj: dict, items: list[dict]) -> None:
        with self._lock, self._conn:
            self._insert_tenant(tenant)
            self._conn.execute("INSERT INTO conversations (id, tenant, created_at, obj) VALUES (?, ?, ?, ?)",
                               (obj["id"], tenant, obj["created_at"], json.dumps(obj)))
            self._insert_items(obj["id"], items)

    def _insert_items(self, conversation: str, items: list[dict]) -> None:
        self._conn.executemany("INSERT INTO conversation_items (id, conversation, obj) VALUES (?, ?, ?)",
                               [(item["id"], conversation, json.dumps(item)) for item in items])

    def get_conversation(self, tenant: str, conversation: str) -> dict | None:
        row = self._one("SELECT obj FROM conversations WHERE id = ? AND tenant = ?", (conversation, tenant))
        return None if row is None else json.loads(row[0])

    def update_conversation(self, tenant: str, conversation: str, metadata: dict[str, str]) -> dict | None:
        """Replace the conversation's metadata; the updated object, or None if the tenant has none by that id."""
        return self._set_metadata("conversations", tenant, conversation, metadata)

    def delete_conversation(self, tenant: str, conversation: str) -> bool:
        """Forget the conversation and its items."""
        with self._lock, self._conn:
            cur = self._conn.execute("DELETE FROM conversations WHERE id = ? AND tenant = ?", (conversation, tenant))
            if cur.rowcount:
                self._conn.execute("DELETE FROM conversation_items WHERE conversation = ?", (conversation,))
        return cur.rowcount > 0

    def add_conversation_items(self, tenant: str, conversation: str, items: list[dict]) -> bool:
        """Append ``items`` (their ids new to the conversation) to the tenant's conversation; False if it has none
        by that id."""
        with self._lock, self._conn:
            if not self._owns_conversation(tenant, conversation):
                return False
            self._insert_items(conversation, items)
        return True

    def _owns_conversation(self, tenant: str, conversation: str) -> bool:
        """Whether the tenant has a conversation by that id (the lock held)."""
        return self._conn.execute("SELECT 1 FROM conversations WHERE id = ? AND tenant = ?",
                                  (conversation, tenant)).fetchone() is not None

    def _conversation_column(self, tenant: str, conversation: str, column: str) -> list | None:
        """One column (``obj`` or ``id``) of the tenant's conversation's items, oldest first; None if it has no
        conversation by that id."""
        with self._lock:
            if not self._owns_conversation(tenant, conversation):
                return None
            rows = self._conn.execute(f"SELECT {column} FROM conversation_items WHERE conversation = ? ORDER BY seq",
                                      (conversation,)).fetchall()
        return [value for (value,) in rows]

    def conversation_items(self, tenant: str, conversation: str) -> list[dict] | None:
        """The tenant's conversation's items, oldest first; None if it has none by that id."""
        objs = self._conversation_column(tenant, conversation, "obj")
        return None if objs is None else [json.loads(obj) for obj in objs]

    def conversation_items_page(self, tenant: str, conversation: str, after: str | None, limit: int,
                                newest_first: bool) -> tuple[list[dict], bool] | None:
        """``limit`` of the tenant's conversation's items after the item ``after`` (from the first where None),
        newest first or oldest first, and whether more follow; None if it has no conversation by that id. KeyError
        where none of its items has the id ``after``."""
        op, order = ("<", "DESC") if newest_first else (">", "ASC")
        with self._lock:
            if not self._owns_conversation(tenant, conversation):
                return None
            where, params = "conversation = ?", [conversation]
            if after is not None:
                row = self._conn.execute("SELECT seq FROM conversation_items WHERE conversation = ? AND id = ?",
                                         (conversation, after)).fetchone()
                if row is None:
                    raise KeyError(after)
                where, params = where + f" AND seq {op} ?", params + [row[0]]
            rows = self._conn.execute(f"SELECT obj FROM conversation_items WHERE {where} ORDER BY seq {order} "
                                      "LIMIT ?", (*params, limit + 1)).fetchall()
        return [json.loads(obj) for (obj,) in rows[:limit]], len(rows) > limit

    def conversation_item(self, tenant: str, conversation: str, item: str) -> dict | None:
        """One item of the tenant's conversation, or None."""
        row = self._one("SELECT i.obj FROM conversation_items i JOIN conversations c ON c.id = i.conversation "
                        "WHERE i.conversation = ? AND i.id = ? AND c.tenant = ?", (conversation, item, tenant))
        return None if row is None else json.loads(row[0])

    def conversation_item_ids(self, tenant: str, conversation: str) -> set[str] | None:
        """The ids of the tenant's conversation's items; None if it has no conversation by that id."""
        ids = self._conversation_column(tenant, conversation, "id")
        return None if ids is None else set(ids)

    def delete_conversation_item(self, tenant: str, conversation: str, item: str) -> bool:
        with self._lock, self._conn:
            cur = self._conn.execute("DELETE FROM conversation_items WHERE conversation = ? AND id = ? AND "
                                     "conversation IN (SELECT id FROM conversations WHERE tenant = ?)",
                                     (conversation, item, tenant))
        return cur.rowcount > 0

    # ---- uploads (OpenAI's Uploads API: a file sent in parts)

    def add_upload(self, tenant: str, upload: dict) -> dict:
        """Store a new upload object built by the caller; returns a copy of it."""
        obj = json.loads(json.dumps(upload))
        with self._lock, self._conn:
            self._insert_object("uploads", tenant, obj)
        return obj

    def get_upload(self, tenant: str | None, upload_id: str) -> dict | None:
        """The tenant's upload object (any tenant's with None), or None."""
        sql, params = "SELECT obj FROM uploads WHERE id = ?", [upload_id]
        if tenant is not None:
            sql, params = sql + " AND tenant = ?", [upload_id, tenant]
        row = self._one(sql, params)
        return None if row is None else json.loads(row[0])

    def update_upload(self, upload_id: str, expect: str, **fields) -> dict | None:
        """Merge ``fields`` into the upload if its status is still ``expect`` (None otherwise); a status it leaves
        pending for drops its parts' rows and bytes."""
        with self._lock, self._conn:
            row = self._conn.execute("SELECT obj FROM uploads WHERE id = ? AND status = ?",
                                     (upload_id, expect)).fetchone()
            if row is None:
                return None
            obj = {**json.loads(row[0]), **fields}
            self._conn.execute("UPDATE uploads SET status = ?, obj = ? WHERE id = ?",
                               (obj["status"], json.dumps(obj), upload_id))
            if obj["status"] != "pending":
                self._conn.execute("DELETE FROM upload_parts WHERE upload_id = ?", (upload_id,))
        if obj["status"] != "pending":
            shutil.rmtree(self.upload_dir(upload_id), ignore_errors=True)
        return obj

    def upload_dir(self, upload_id: str) -> Path:
        """Where the parts of ``upload_id`` lie; ValueError unless it is an upload id."""
        if not isinstance(upload_id, str) or not _UPLOAD_ID.fullmatch(upload_id):
            raise ValueError(f"upload_id: {upload_id!r} is not an upload id (upload-<24 hex>)")
        return self.uploads_dir / upload_id

    def add_upload_part(self, upload_id: str, data: bytes, limit: int) -> dict | None:
        """Store a part of the pending upload (bytes first, then the row): its part object, or None when the upload
        is no longer pending. ValueError when the parts would hold more than ``limit`` bytes together."""
        part_id = self.new_id("part")
        folder = self.upload_dir(upload_id)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / part_id
        write_atomically(path, bytes(data))
        row = (part_id, upload_id, len(data), _now())
        try:
            with self._lock, self._conn:
                if self._conn.execute("SELECT 1 FROM uploads WHERE id = ? AND status = 'pending'",
                                      (upload_id,)).fetchone() is None:
                    path.unlink(missing_ok=True)
                    return None
                (held,) = self._conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM upload_parts WHERE upload_id = ?",
                                             (upload_id,)).fetchone()
                if held + len(data) > limit:
                    raise ValueError(f"data: the parts would hold {held + len(data)} bytes; the upload was created "
                                     f"for {limit}")
                self._conn.execute("INSERT INTO upload_parts (id, upload_id, bytes, created_at) VALUES (?, ?, ?, ?)",
                                   row)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return {"id": part_id, "object": "upload.part", "created_at": row[3], "upload_id": upload_id}

    def upload_parts(self, upload_id: str) -> dict[str, int]:
        """The upload's parts: part id -> bytes, in the order they arrived."""
        return dict(self._all("SELECT id, bytes FROM upload_parts WHERE upload_id = ? ORDER BY seq", (upload_id,)))

    def uploads_with_status(self, *statuses: str) -> list[dict]:
        """Every upload in one of ``statuses``, oldest first."""
        where, params = _in(statuses)
        return [json.loads(obj) for (obj,) in
                self._all(f"SELECT obj FROM uploads WHERE {where} ORDER BY seq", params)]

    # ---- batches (OpenAI's Batch API)

    def add_batch(self, tenant: str, batch: dict) -> dict:
        """Store a new batch object built by the caller; returns a copy of it."""
        obj = json.loads(json.dumps(batch))
        with self._lock, self._conn:
            self._insert_object("batches", tenant, obj)
        return obj

    def update_batch(self, batch_id: str, **fields) -> dict:
        """Merge ``fields`` into the stored batch; returns the new object; KeyError if absent."""
        with self._lock, self._conn:
            row = self._conn.execute("SELECT obj FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                raise KeyError(f"batch_id: no batch {batch_id!r}")
            obj = {**json.loads(row[0]), **fields}
            self._conn.execute("UPDATE batches SET status = ?, obj = ? WHERE id = ?",
                               (obj["status"], json.dumps(obj), batch_id))
        return obj

    def get_batch(self, tenant: str, batch_id: str) -> dict | None:
        """The tenant's batch object, or None (absent, or another tenant's)."""
        row = self._one("SELECT obj FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant))
        return None if row is None else json.loads(row[0])

    def list_batches(self, tenant: str, after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        """The tenant's batches, newest first, after the batch ``after``; (page, has_more)."""
        return self._page("batches", "seq", "tenant = ?", [tenant], after, limit, "a batch of this tenant")

    def count_batches(self) -> dict[str, int]:
        """How many batches are in each status (of every tenant)."""
        return dict(self._all("SELECT status, COUNT(*) FROM batches GROUP BY status"))

    def batches_with_status(self, *statuses: str) -> list[tuple[str, dict]]:
        """``(tenant, batch)`` of every batch in one of ``statuses``, oldest first."""
        where, params = _in(statuses)
        return [(tenant, json.loads(obj)) for tenant, obj in
                self._all(f"SELECT tenant, obj FROM batches WHERE {where} ORDER BY seq", params)]

    # ---- evals (OpenAI's Evals API) and their runs

    def add_eval(self, tenant: str, obj: dict) -> dict:
        obj = json.loads(json.dumps(obj))
        with self._lock, self._conn:
            self._insert_object("evals", tenant, {**obj, "status": "active"})
        return obj

    def get_eval(self, tenant: str, eval_id: str) -> dict | None:
        row = self._one("SELECT obj FROM evals WHERE id = ? AND tenant = ?", (eval_id, tenant))
        return None if row is None else _public(json.loads(row[0]))

    def update_eval(self, eval_id: str, **fields) -> dict:
        return _public(self._update("evals", eval_id, fields))

    def list_evals(self, tenant: str, after: str | None = None, limit: int = 20,
                   ascending: bool = True) -> tuple[list[dict], bool]:
        page, more = self._page("evals", "seq", "tenant = ?", [tenant], after, limit, "an eval of this tenant",
                                ascending)
        return [_public(e) for e in page], more

    def delete_eval(self, tenant: str, eval_id: str) -> bool:
        """Delete the tenant's eval with its runs and their output items; False if it has none so named."""
        with self._lock, self._conn:
            if self._conn.execute("SELECT 1 FROM evals WHERE id = ? AND tenant = ?", (eval_id, tenant)).fetchone() \
                    is None:
                return False
            self._conn.execute("DELETE FROM eval_items WHERE run_id IN (SELECT id FROM eval_runs WHERE eval_id = ?)",
                               (eval_id,))
            self._conn.execute("DELETE FROM eval_runs WHERE eval_id = ?", (eval_id,))
            self._conn.execute("DELETE FROM evals WHERE id = ?", (eval_id,))
        return True

    def add_eval_run(self, tenant: str, run: dict) -> dict:
        obj = json.loads(json.dumps(run))
        with self._lock, self._conn:
            self._insert_tenant(tenant)
            self._conn.execute("INSERT INTO eval_runs (id, tenant, status, created_at, obj, eval_id) VALUES "
                               "(?, ?, ?, ?, ?, ?)", (obj["id"], tenant, obj["status"], obj["created_at"],
                                                      json.dumps(obj), obj["eval_id"]))
        return obj

    def update_eval_run(self, run_id: str, **fields) -> dict:
        return self._update("eval_runs", run_id, fields)

    def get_eval_run(self, tenant: str, eval_id: str, run_id: str) -> dict | None:
        row = self._one("SELECT obj FROM eval_runs WHERE id = ? AND eval_id = ? AND tenant = ?",
                        (run_id, eval_id, tenant))
        return None if row is None else json.loads(row[0])

    def list_eval_runs(self, tenant: str, eval_id: str, after: str | None = None, limit: int = 20,
                       ascending: bool = True, status: str | None = None) -> tuple[list[dict], bool]:
        where, params = "tenant = ? AND eval_id = ?", [tenant, eval_id]
        if status is not None:
            where, params = f"{where} AND status = ?", [*params, status]
        return self._page("eval_runs", "seq", where, params, after, limit, "a run of this eval", ascending)

    def eval_runs_with_status(self, *statuses: str) -> list[tuple[str, dict]]:
        """``(tenant, run)`` of every eval run in one of ``statuses``, oldest first."""
        where, params = _in(statuses)
        return [(tenant, json.loads(obj)) for tenant, obj in
                self._all(f"SELECT tenant, obj FROM eval_runs WHERE {where} ORDER BY seq", params)]

    def delete_eval_run(self, tenant: str, eval_id: str, run_id: str) -> bool:
        with self._lock, self._conn:
            if self._conn.execute("SELECT 1 FROM eval_runs WHERE id = ? AND eval_id = ? AND tenant = ?",
                                  (run_id, eval_id, tenant)).fetchone() is None:
                return False
            self._conn.execute("DELETE FROM eval_items WHERE run_id = ?", (run_id,))
            self._conn.execute("DELETE FROM eval_runs WHERE id = ?", (run_id,))
        return True

    def add_eval_item(self, run_id: str, obj: dict) -> None:
        """A run's output item (its ``datasource_item_id`` once: a run resumed after a restart skips those done)."""
        with self._lock, self._conn:
            self._conn.execute("INSERT OR IGNORE INTO eval_items (id, run_id, item, status, obj) VALUES "
                               "(?, ?, ?, ?, ?)", (obj["id"], run_id, obj["datasource_item_id"], obj["status"],
                                                   json.dumps(obj)))

    def eval_items_done(self, run_id: str) -> list[dict]:
        return [json.loads(obj) for (obj,) in
                self._all("SELECT obj FROM eval_items WHERE run_id = ? ORDER BY item", (run_id,))]

    def list_eval_items(self, run_id: str, after: str | None = None, limit: int = 20, ascending: bool = True,
                        status: str | None = None) -> tuple[list[dict], bool]:
        where, params = "run_id = ?", [run_id]
        if status is not None:
            where, params = f"{where} AND status = ?", [*params, status]
        return self._page("eval_items", "item", where, params, after, limit, "an output item of this run", ascending)

    def get_eval_item(self, run_id: str, item_id: str) -> dict | None:
        row = self._one("SELECT obj FROM eval_items WHERE id = ? AND run_id = ?", (item_id, run_id))
        return None if row is None else json.loads(row[0])

    def _update(self, table: str, row_id: str, fields: dict) -> dict:
        """Merge ``fields`` into a row's object (``table``: a constant of this module); KeyError if absent."""
        with self._lock, self._conn:
            row = self._conn.execute(f"SELECT obj FROM {table} WHERE id = ?", (row_id,)).fetchone()
            if row is None:
                raise KeyError(f"{row_id!r} is not in {table}")
            obj = {**json.loads(row[0]), **fields}
            self._conn.execute(f"UPDATE {table} SET status = ?, obj = ? WHERE id = ?",
                               (obj.get("status", "active"), json.dumps(obj), row_id))
        return obj

    # ---- fine-tuning jobs

    def add_job(self, tenant: str, job: dict) -> dict:
        """Store a complete job object built by the caller; returns a copy of it."""
        for key in ("id", "status"):
            if not isinstance(job.get(key), str) or not job[key]:
                raise ValueError(f"job.{key}: must be a non-empty string, got {job.get(key)!r}")
        obj = json.loads(json.dumps(job))
        obj.setdefault("created_at", _now())
        with self._lock:
            if self.job_tenant(obj["id"]) is not None:
                raise ValueError(f"job.id: a job {obj['id']!r} already exists")
            with self._conn:
                self._insert_object("jobs", tenant, obj)
        return obj

    def update_job(self, job_id: str, **fields) -> dict:
        """Merge ``fields`` into the stored job; returns the new object; KeyError if absent."""
        if "id" in fields and fields["id"] != job_id:
            raise ValueError(f"id: a job's id cannot change ({job_id!r} -> {fields['id']!r})")
        with self._lock, self._conn:
            row = self._conn.execute("SELECT obj FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise KeyError(f"job_id: no job {job_id!r}")
            obj = {**json.loads(row[0]), **fields}
            self._conn.execute("UPDATE jobs SET status = ?, obj = ? WHERE id = ?",
                               (obj["status"], json.dumps(obj), job_id))
        return obj

    def get_job(self, tenant: str | None, job_id: str) -> dict | None:
        """The job object, or None; ``tenant=None`` finds a job of any tenant."""
        if tenant is None:
            row = self._one("SELECT obj FROM jobs WHERE id = ?", (job_id,))
        else:
            row = self._one("SELECT obj FROM jobs WHERE id = ? AND tenant = ?", (job_id, tenant))
        return None if row is None else json.loads(row[0])

    def job_tenant(self, job_id: str) -> str | None:
        """The tenant owning ``job_id``, or None when there is no such job."""
        row = self._one("SELECT tenant FROM jobs WHERE id = ?", (job_id,))
        return None if row is None else row[0]

    def list_jobs(self, tenant: str, metadata: dict[str, str] | None = None, without_metadata: bool = False,
                  after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        """One page of the tenant's jobs, newest first, older than job ``after``: those whose metadata holds every
        pair of ``metadata`` (OpenAI's filter), or only those without metadata."""
        where, params = "tenant = ?", [tenant]
        if without_metadata:
            where += " AND json_extract(obj, '$.metadata') IS NULL"
        where, params = _metadata_where(where, params, metadata)
        return self._page("jobs", "seq", where, params, after, limit, "a job of this tenant")

    def jobs_with_status(self, *statuses: str) -> list[tuple[str, dict]]:
        """(tenant, job) for every job of any tenant in ``statuses`` (all if none), oldest first."""
        where, params = _in(statuses)
        rows = self._all(f"SELECT tenant, obj FROM jobs WHERE {where} ORDER BY seq", params)
        return [(tenant, json.loads(obj)) for tenant, obj in rows]

    def count_jobs(self, *statuses: str, tenant: str | None = None) -> int:
        """How many jobs are in ``statuses`` (all if none), of ``tenant`` or of everyone."""
        where, params = _in(statuses)
        if tenant is not None:
            where, params = f"{where} AND tenant = ?", [*params, tenant]
        return self._one(f"SELECT COUNT(*) FROM jobs WHERE {where}", params)[0]

    # ---- job events

    def add_event(self, job_id: str, message: str, level: str = "info", type: str = "message",
                  data: dict | None = None) -> dict:
        """Append an event to a job; KeyError if the job does not exist."""
        obj = {"id": self.new_id("ftevent"), "object": "fine_tuning.job.event",
               "created_at": _now(), "level": level, "message": message, "type": type,
               "data": json.loads(json.dumps(data or {}))}
        step = obj["data"].get("step") if type == "metrics" else None
        with self._lock:
            self._require_job(job_id)
            with self._conn:
                self._conn.execute("INSERT INTO events (id, job_id, step, obj) VALUES (?, ?, ?, ?)",
                                   (obj["id"], job_id, step, json.dumps(obj)))
        return obj

    def list_events(self, job_id: str, after: str | None = None,
                    limit: int = 20) -> tuple[list[dict], bool]:
        """One page of a job's events, newest first, older than event ``after``."""
        return self._page("events", "seq", "job_id = ?", [job_id], after, limit,
                          "an event of this job")

    def has_step_event(self, job_id: str, step: int) -> bool:
        """Whether a metrics event for ``step`` was already recorded for the job."""
        return self._one("SELECT 1 FROM events WHERE job_id = ? AND step = ? LIMIT 1",
                         (job_id, step)) is not None

    # ---- checkpoints

    def add_checkpoint(self, job_id: str, step: int, path: str, fine_tuned_model_checkpoint: str,
                       metrics: dict) -> dict:
        """Record the adapter saved at ``step``, replacing one recorded for the same step."""
        obj = {"id": self.new_id("ftckpt"), "object": "fine_tuning.job.checkpoint",
               "created_at": _now(), "fine_tuning_job_id": job_id,
               "fine_tuned_model_checkpoint": fine_tuned_model_checkpoint,
               "step_number": int(step), "metrics": json.loads(json.dumps(metrics))}
        with self._lock:
            self._require_job(job_id)
            with self._conn:
                self._conn.execute(
                    "INSERT OR REPLACE INTO checkpoints (id, job_id, step, path, model, obj)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (obj["id"], job_id, int(step), str(path), fine_tuned_model_checkpoint,
                     json.dumps(obj)))
        return obj

    def list_checkpoints(self, job_id: str, after: str | None = None,
                         limit: int = 10) -> tuple[list[dict], bool]:
        """One page of a job's checkpoints, highest step first, below checkpoint ``after``."""
        return self._page("checkpoints", "step", "job_id = ?", [job_id], after, limit,
                          "a checkpoint of this job")

    def latest_checkpoint(self, job_id: str) -> tuple[dict, str] | None:
        """(object, adapter path) of the job's highest-step checkpoint, or None."""
        row = self._one("SELECT obj, path FROM checkpoints WHERE job_id = ?"
                        " ORDER BY step DESC LIMIT 1", (job_id,))
        return None if row is None else (json.loads(row[0]), row[1])

    def checkpoint_by_model(self, name: str) -> tuple[str, str] | None:
        """(job id, adapter path) of the checkpoint named ``name``, or None."""
        row = self._one("SELECT job_id, path FROM checkpoints WHERE model = ?"
                        " ORDER BY seq DESC LIMIT 1", (name,))
        return None if row is None else (row[0], row[1])

    # ---- shared pieces

    def _require_job(self, job_id: str) -> None:
        if self._conn.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone() is None:
            raise KeyError(f"job_id: no job {job_id!r}")

    def _page(self, table: str, key: str, where: str, params: list, after: str | None,
              limit: int, what: str, ascending: bool = False) -> tuple[list[dict], bool]:
        """Rows of ``table`` by ``key`` descending (or ascending), past the row ``after``; (page, has_more).

        ``table``, ``key``, ``where`` are constants of this module, never user input.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit: must be a positive integer, got {limit!r}")
        with self._lock:
            if after is not None:
                row = self._conn.execute(f"SELECT {key} FROM {table} WHERE id = ? AND {where}",
                                         [after, *params]).fetchone()
                if row is None:
                    raise ValueError(f"after: {after!r} is not {what}")
                where, params = f"{where} AND {key} {'>' if ascending else '<'} ?", [*params, row[0]]
            sql = f"SELECT obj FROM {table} WHERE {where} ORDER BY {key} {'ASC' if ascending else 'DESC'} LIMIT ?"
            rows = self._conn.execute(sql, [*params, limit + 1]).fetchall()
        return [json.loads(obj) for (obj,) in rows[:limit]], len(rows) > limit


_FILE_COLS = "id, tenant, filename, purpose, bytes, created_at"


def _file_object(row: tuple) -> dict:
    """The OpenAI file object for a ``files`` row in ``_FILE_COLS`` order."""
    file_id, _tenant, filename, purpose, size, created_at = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at,
            "filename": filename, "purpose": purpose, "status": "processed",
            "status_details": None}


def _public(obj: dict) -> dict:
    """A stored object without the row's bookkeeping (``status`` of an eval, which OpenAI's eval object lacks)."""
    return {k: v for k, v in obj.items() if k != "status"}
