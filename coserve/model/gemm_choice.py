"""The packed-GEMM backend a machine was timed to run best, kept on disk so that every process on it agrees.

Timing both backends at each start let a loaded moment pick the other one now and then (seen on a 2-core Intel Xeon:
oneDNN in one process of seven). Another backend rounds differently, so greedy outputs and logprobs could change
from one start of a server to the next, and the latency profile, keyed by the backend, no longer fitted. The first
process on a machine times them; later ones read its answer from ``$COSERVE_GEMMS_FILE`` (default
``~/.cache/coserve/gemms.json``), keyed by what the timing depends on: the CPU, torch, the thread count and MKL's
reproducibility mode. Delete the file to time again; ``$COSERVE_GEMMS`` names a backend outright.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger("coserve.model")


def choice_path() -> Path:
    return Path(os.environ.get("COSERVE_GEMMS_FILE", Path.home() / ".cache" / "coserve" / "gemms.json"))


def machine_key() -> str:
    """What a timed choice holds for: the CPU's model name, torch's version, the threads and MKL's mode."""
    return "|".join((_cpu_name(), torch.__version__, f"threads={torch.get_num_threads()}",
                     f"MKL_CBWR={os.environ.get('MKL_CBWR', '')}"))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def saved_choice(names: list[str]) -> str | None:
    """This machine's kept choice, if one of ``names`` is kept for it (an unreadable file keeps nothing)."""
    try:
        entry = json.loads(choice_path().read_text()).get(machine_key())
    except (OSError, ValueError, AttributeError):
        return None
    backend = entry.get("backend") if isinstance(entry, dict) else None
    return backend if backend in names else None


def save_choice(backend: str, seconds: dict[str, float]) -> None:
    """Keep ``backend`` (timed at ``seconds``) for this machine; a file that cannot be written is only logged."""
    path = choice_path()
    try:
        try:
            table = json.loads(path.read_text())
            table = table if isinstance(table, dict) else {}
        except (OSError, ValueError):
            table = {}
        table[machine_key()] = {"backend": backend, "seconds": seconds}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=2))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not keep the GEMM backend choice in %s (%s); the next process times it again", path, e)
