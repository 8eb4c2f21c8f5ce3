"""Atomic checkpoints: an adapter in HF PEFT format plus optimizer state, replaced as a whole."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "training_state.json"
LOG_FILE = "training_log.jsonl"


def write_dir_atomically(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Fill a fresh sibling temp dir with ``write`` and swap it in for ``out_dir``.

    A crash at any point leaves either the previous directory whole or the new one whole;
    ``recover`` restores the previous one if the crash fell between the two renames.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    recover(out_dir)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    old = out_dir.with_name(f".{out_dir.name}.old")
    try:
        write(tmp)
        if out_dir.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def recover(out_dir: Path) -> None:
    """Bring back the previous checkpoint if a save was interrupted between its renames."""
    old = out_dir.with_name(f".{out_dir.name}.old")
    if not out_dir.exists() and old.exists():
        os.replace(old, out_dir)


def save_checkpoint(out_dir: Path, bypass, optimizer: torch.optim.Optimizer, scheduler, step: int,
                    base_model: str, state: dict) -> None:
    """Adapter files, optimizer and scheduler state, and a JSON summary, atomically; keeps the log."""
    out_dir = Path(out_dir)

    def write(tmp: Path) -> None:
        bypass.save_pretrained(tmp, base_model)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step},
                   tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=2))
        log = out_dir / LOG_FILE
        if log.is_file():
            shutil.copy2(log, tmp / LOG_FILE)

    write_dir_atomically(out_dir, write)


def load_optimizer_state(adapter_dir: Path) -> dict | None:
    """The optimizer/scheduler state saved beside an adapter, or None if there is none."""
    path = Path(adapter_dir) / OPTIMIZER_FILE
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several kinds for a bad file
        raise ValueError(f"{path}: cannot read the optimizer state ({e})") from e
