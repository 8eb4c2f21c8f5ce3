"""Starting a live ``coserve serve`` process for tests, and waiting on it."""

from __future__ import annotations

import json
import os
import signal
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


def train_replies(model: Path, pairs: list[tuple[list[dict], str]], out: Path) -> Path:
    """A LoRA adapter (r=8 on all-linear, 60 steps, ``coserve finetune``) that makes ``model`` answer each pair's
    messages with its reply, as the reasoning and harmony tests need a random model to; returns ``out``."""
    from coserve.cli import main
    data = out.with_suffix(".jsonl")
    data.write_text("\n".join(json.dumps({"messages": [*msgs, {"role": "assistant", "content": reply}]})
                              for msgs, reply in pairs))
    assert main(["finetune", "--model", str(model), "--data", str(data), "--output", str(out), "--max-steps", "60",
                 "--batch-size", "2", "--lr", "0.01", "--lora-r", "8", "--lora-alpha", "16", "--target-modules",
                 "all-linear", "--no-progress"]) == 0
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ForkedProcess:
    """A ``multiprocessing`` process behind ``subprocess.Popen``'s calls (``poll``, ``wait``, ``terminate``,
    ``kill``, ``pid``, ``returncode``), for servers forked from the benchmark runs' fork server."""

    def __init__(self, proc) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired("coserve serve", timeout)
        return self._proc.exitcode

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()


def _serve(argv: list[str], log: str, env: dict[str, str]) -> None:
    """``coserve serve`` in a forked process: a session of its own (a SIGKILL to its group takes only it), its
    output appended to ``log``, the caller's environment."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    from coserve.cli import main
    sys.exit(main(argv))


@dataclass
class LiveServer:
    proc: subprocess.Popen | ForkedProcess
    port: int
    state_dir: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def crash(self) -> None:
        """SIGKILL the server's process group and reap it: a crash in the middle of whatever it was doing."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(model: Path, state_dir: Path, *extra: str, port: int | None = None,
                 timeout: float = 120, fork: bool = True) -> LiveServer:
    """``coserve serve`` in a child process (its own session, so a SIGKILL takes only it); waits for /health.

    ``fork``: forked from the fork server the benchmark runs start from (``coserve.bench.spawned``), which has
    imported the serving stack once (about 5 s a start on a 2-core CPU); else ``python -m coserve.cli serve``, as a
    user runs it. Where that context is ``spawn`` (a GPU visible), forking costs what the command does."""
    port = port or free_port()
    log = state_dir.parent / f"{state_dir.name}-server-{port}.log"
    argv = ["serve", "--model", str(model), "--state-dir", str(state_dir), "--port", str(port), "--dtype", "float32",
            "--device", "cpu", "--log-level", "warning", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if fork:
        from coserve.bench.spawned import context
        child = context().Process(target=_serve, args=(argv, str(log), env))
        child.start()
        proc = ForkedProcess(child)
    else:
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "coserve.cli", *argv], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
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


def refused_job(client, model: str, training_id: str, method: dict, extra: dict) -> dict:
    """The 400's error body for a fine-tuning job that must be refused (``extra``'s value "same": the training
    file's id, e.g. as the validation file)."""
    import openai
    extra = {k: training_id if v == "same" else v for k, v in extra.items()}
    try:
        client.fine_tuning.jobs.create(model=model, training_file=training_id, method=method, **extra)
    except openai.BadRequestError as e:
        return e.body
    raise AssertionError(f"the job was created: method {method}, {extra}")


def wait_for_job(client, job_id: str, statuses=("succeeded", "failed", "cancelled"), timeout: float = 180):
    """Poll a fine-tuning job until its status is one of ``statuses``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {job.status} after {timeout} s")
