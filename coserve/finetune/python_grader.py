"""OpenAI's ``python`` grader: source that defines ``grade(sample, item) -> float``, run in a separate Python process
(isolated mode: no user site, no ``PYTHON*`` variables, a bare environment) with a time limit and, on POSIX systems,
limits on its memory (2 GiB of address space) and on the files it writes (64 MiB each), on a whole batch of samples
at once. On Linux, where the kernel lets a process take a network namespace of its own (as root, or through a user
namespace), the process has no network, as OpenAI's python grader has none (``network_isolated`` says whether the
last run had it; the first run without it logs a warning). Each sample's outcome comes back on its own: a number, or
the error its call raised. It is not a sandbox: the code runs with the server user's rights on files."""

from __future__ import annotations

import ast
import json
import logging
import math
import subprocess
import sys

log = logging.getLogger("coserve.finetune")

TIMEOUT_S = 120.0  # a batch's limit (OpenAI's python grader allows two minutes)
MAX_SOURCE = 256 * 1024  # characters of source
MEMORY_BYTES = 2 * 2**30  # the process's address space (OpenAI's python grader has 2 GB of memory)
FILE_BYTES = 64 * 2**20  # the largest file it may write

_RUNNER = r"""
import json, math, sys
job = json.load(sys.stdin)
isolated = False
try:  # no network: a network namespace of its own (no interface up), before the grader's code runs
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    isolated = libc.unshare(0x40000000) == 0 or libc.unshare(0x10000000 | 0x40000000) == 0  # NEWNET, +NEWUSER
except (OSError, AttributeError):  # not Linux, or no unshare
    pass
try:  # the limits bind before the grader's code runs, soft and hard alike, so it cannot raise them
    import resource
    for limit, value in ((resource.RLIMIT_AS, job["memory"]), (resource.RLIMIT_FSIZE, job["file_bytes"])):
        resource.setrlimit(limit, (value, value))
except ImportError:  # not a POSIX system
    pass
space = {"__name__": "grader"}
exec(compile(job["source"], "<grader source>", "exec"), space)
grade = space["grade"]
out = []
for sample, item in job["pairs"]:
    try:
        value = grade(sample, item)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"grade() returned {value!r}, not a finite number")
        out.append({"value": float(value)})
    except Exception as e:
        out.append({"error": f"{type(e).__name__}: {e}"})
sys.stdout.write("\n" + json.dumps({"isolated": isolated, "out": out}))
"""


network_isolated: bool | None = None  # whether the last python grader ran without network (None: none has run)


def _note_isolation(isolated: bool) -> None:
    global network_isolated
    if not isolated and network_isolated is not False:
        log.warning("python graders run with the network: this kernel lets no process take a network namespace of "
                    "its own (unshare CLONE_NEWNET)")
    network_isolated = isolated


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
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _RUNNER], input=job, capture_output=True, text=True,
                              timeout=timeout_s, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"})
    except subprocess.TimeoutExpired:
        raise ValueError(f"the python grader took more than {timeout_s:g} s for {len(pairs)} sample(s)") from None
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise ValueError(f"the python grader failed: {last[0]}")
    try:  # what grade() printed comes before the results' line
        reply = json.loads(done.stdout.rsplit("\n", 1)[-1])
        results, isolated = reply["out"], reply["isolated"] is True
    except (ValueError, TypeError, KeyError):
        raise ValueError("the python grader's process wrote no results") from None
    _note_isolation(isolated)
    out: list[float | str] = []
    for r in results:
        value = r.get("value")
        out.append(value if isinstance(value, float) and math.isfinite(value) else str(r.get("error")))
    return out
