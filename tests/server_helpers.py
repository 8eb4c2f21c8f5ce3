"""Starting a live ``coserve serve`` process for tests, and waiting on it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

CHAT_EXAMPLES = [
    ("What is the capital of France?", "Paris is the capital of France."),
    ("Name a primary color.", "Red is a primary color."),
    ("What is two plus two?", "Two plus two is four."),
    ("Which planet is red?", "Mars is the red planet."),
    ("What do bees make?", "Bees make honey."),
    ("What is frozen water?", "Frozen water is ice."),
]


API_KEYS = {"alice": "key-api-alice", "bob": "key-api-bob"}  # the shared ``api_server``'s tenants (conftest.py)
API_PART_BYTES = 4096  # its --max-upload-bytes: a POST /v1/files body, or an upload's part, at most
API_FILE_BYTES = 20_000  # its --max-file-bytes: a file made of an upload's parts, at most


def chat_jsonl(examples=CHAT_EXAMPLES) -> bytes:
    lines = [json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
             for q, a in examples]
    return ("\n".join(lines) + "\n").encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    port: int
    state_dir: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(model: Path, state_dir: Path, *extra: str, port: int | None = None,
                 timeout: float = 120) -> LiveServer:
    """``coserve serve`` in a child process (its own session, so a SIGKILL takes only it); waits for /health."""
    port = port or free_port()
    log = state_dir.parent / f"{state_dir.name}-server-{port}.log"
    cmd = [sys.executable, "-m", "coserve.cli", "serve", "--model", str(model), "--state-dir", str(state_dir),
           "--port", str(port), "--dtype", "float32", "--device", "cpu", "--log-level", "warning", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = LiveServer(proc, port, state_dir, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(kill=True)
    raise RuntimeError(f"the server did not come up in {timeout} s:\n{log.read_text()[-4000:]}")


def wait_for_job(client, job_id: str, statuses=("succeeded", "failed", "cancelled"), timeout: float = 180):
    """Poll a fine-tuning job until its status is one of ``statuses``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {job.status} after {timeout} s")
