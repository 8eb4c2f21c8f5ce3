"""OpenAI's ``python`` grader: source that defines ``grade(sample, item) -> float``, run in a separate Python process
(``grader_runner.py``; isolated mode: no user site, no ``PYTHON*`` variables, a bare environment, a fresh temporary
working directory) with a time limit and, on POSIX systems, limits on its memory (2 GiB of address space) and on the
files it writes (64 MiB each), on a whole batch of samples at once. On Linux, as far as the kernel allows, the
process has no network (a namespace of its own, and a seccomp filter that refuses it Internet sockets; Landlock
refuses it TCP too), as OpenAI's python grader has none, and reads only Python's and the system's libraries,
writing only within its own directory (Landlock): ``network_isolated``, ``sockets_refused`` and
``filesystem_isolated`` say what the last run had, and the first run without network or filesystem isolation logs
a warning. Each sample's outcome comes back on its own: a number, or the error its call raised."""

from __future__ import annotations

import ast
import json
import logging
import math
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("coserve.finetune")

TIMEOUT_S = 120.0  # a batch's limit (OpenAI's python grader allows two minutes)
MAX_SOURCE = 256 * 1024  # characters of source
MEMORY_BYTES = 2 * 2**30  # the process's address space (OpenAI's python grader has 2 GB of memory)
FILE_BYTES = 64 * 2**20  # the largest file it may write

RUNNER = Path(__file__).with_name("grader_runner.py")  # the process's script

network_isolated: bool | None = None  # whether the last python grader ran without network (None: none has run)
filesystem_isolated: bool | None = None  # whether it ran shut in its own directory (Landlock)
sockets_refused: bool | None = None  # whether its Internet sockets were refused (seccomp)


def _note_isolation(isolation: dict) -> None:
    global network_isolated, filesystem_isolated, sockets_refused
    network, filesystem = isolation.get("network") is True, isolation.get("filesystem") is True
    if not network and network_isolated is not False:
        log.warning("python graders run with the network: this kernel lets no process take a network namespace of "
                    "its own (unshare CLONE_NEWNET), filter its sockets (seccomp) nor restrict its TCP (Landlock "
                    "ABI 4)")
    if not filesystem and filesystem_isolated is not False:
        log.warning("python graders can read the server's files: this kernel has no Landlock (5.13 and later) to "
                    "shut them in their own directory")
    network_isolated, filesystem_isolated = network, filesystem
    sockets_refused = isolation.get("sockets") is True


def check_source(source: object, where: str) -> str:
    """The source, if it parses and defines ``grade`` at its top level; ValueError naming ``where`` otherwise."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"{where}: expected Python source that defines grade(sample, item)")
    if len(source) > MAX_SOURCE:
        raise ValueError(f"{where}: {len(source)} characters; at most {MAX_SOURCE}")
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"{where}: line {e.lineno}: {e.msg}") from None
    if not any(isinstance(n, ast.FunctionDef) and n.name == "grade" for n in tree.body):
        raise ValueError(f"{where}: defines no top-level function grade(sample, item)")
    return source


def run_python_grader(source: str, pairs: list[tuple[dict, dict]], timeout_s: float = TIMEOUT_S
                      ) -> list[float | str]:
    """``grade(sample, item)`` for each pair, in a fresh process: a float, or the error as text. A failure of the
    whole run (the source raises on import, the time limit, a crash) is a ValueError."""
    if not pairs:
        return []
    job = json.dumps({"source": source, "pairs": pairs, "memory": MEMORY_BYTES, "file_bytes": FILE_BYTES})
    with tempfile.TemporaryDirectory(prefix="coserve-grader-") as workdir:  # its own directory, gone after
        try:
            done = subprocess.run([sys.executable, "-I", str(RUNNER)], input=job, capture_output=True, text=True,
                                  timeout=timeout_s, cwd=workdir, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8",
                                                                       "HOME": workdir, "TMPDIR": workdir})
        except subprocess.TimeoutExpired:
            raise ValueError(f"the python grader took more than {timeout_s:g} s for {len(pairs)} sample(s)") from None
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise ValueError(f"the python grader failed: {last[0]}")
    try:  # what grade() printed comes before the results' line
        reply = json.loads(done.stdout.rsplit("\n", 1)[-1])
        results, isolation = reply["out"], dict(reply["isolation"])
    except (ValueError, TypeError, KeyError):
        raise ValueError("the python grader's process wrote no results") from None
    _note_isolation(isolation)
    out: list[float | str] = []
    for r in results:
        value = r.get("value")
        out.append(value if isinstance(value, float) and math.isfinite(value) else str(r.get("error")))
    return out
