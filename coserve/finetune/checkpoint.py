"""Atomic checkpoints: an adapter in HF PEFT format plus optimizer state, replaced as a whole."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coserve.peft.adapter_dir import write_adapter_files

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "training_state.json"
LOG_FILE = "training_log.jsonl"
GRPO_LOG_FILE = "grpo_log.jsonl"  # GRPO: each step's rewards and completion lengths
ROLLOUTS_FILE = "rollouts.jsonl"  # GRPO: every sampled completion, its reward and advantage
GRPO_VALID_FILE = "grpo_valid.jsonl"  # GRPO: each validation's rewards, and its completions
KEPT_LOGS = (LOG_FILE, GRPO_LOG_FILE, ROLLOUTS_FILE, GRPO_VALID_FILE)  # carried into each new checkpoint of a directory
CHECKPOINT_PREFIX = "checkpoint-"  # output_dir/checkpoint-STEP: numbered checkpoints, as HF Trainer names them


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


@dataclass(frozen=True, slots=True)
class CheckpointSnapshot:
    """A checkpoint's contents copied out of the live job (CPU tensors that training no longer touches), so that
    writing it can happen on another thread while training goes on."""

    adapter: dict[str, torch.Tensor]  # HF PEFT tensor names -> CPU copies
    adapter_config: dict  # adapter_config.json
    trainer: dict  # optimizer and scheduler state and the step, as optimizer.pt holds them
    state: dict  # training_state.json
    logs: dict[str, str] = field(default_factory=dict)  # text appended to kept logs (KEPT_LOGS) with this checkpoint


def snapshot_checkpoint(bypass, optimizer: torch.optim.Optimizer, scheduler, step: int, tokens: int,
                        base_model: str, state: dict, extra: dict | None = None) -> CheckpointSnapshot:
    """Copy what a checkpoint holds (``tokens``: trained by its ``step`` steps; ``extra``: what the kind of job
    keeps for its resume, beside the optimizer state); the only part of a save that must run where the job
    trains."""
    return CheckpointSnapshot(
        adapter={k: v.to("cpu", copy=True) for k, v in bypass.state_dict().items()},
        adapter_config=bypass.peft_config(base_model),
        trainer=_copied({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                         "tokens": tokens, **({"extra": extra} if extra else {})}),
        state={"step": step, **state})


def write_checkpoint(out_dir: Path, snap: CheckpointSnapshot) -> None:
    """Adapter files, optimizer and scheduler state, and a JSON summary, atomically; keeps ``out_dir``'s logs
    (``KEPT_LOGS``, with ``snap.logs`` appended) and its numbered checkpoints (``checkpoint-STEP`` directories,
    hard-linked into the new directory, not copied)."""
    out_dir = Path(out_dir)

    def write(tmp: Path) -> None:
        write_adapter_files(tmp, snap.adapter, snap.adapter_config)
        torch.save(snap.trainer, tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(snap.state, indent=2))
        for name in KEPT_LOGS:
            if (out_dir / name).is_file():
                shutil.copy2(out_dir / name, tmp / name)
        for name, text in snap.logs.items():  # lines that must land together with this state (a GRPO step's)
            with open(tmp / name, "a") as f:
                f.write(text)
        if out_dir.is_dir():
            for child in out_dir.iterdir():
                if child.is_dir() and child.name.startswith(CHECKPOINT_PREFIX):
                    shutil.copytree(child, tmp / child.name, copy_function=os.link)

    write_dir_atomically(out_dir, write)


def _copied(obj):
    """``obj`` with every tensor in it copied to the CPU (optimizer state dicts hold the live tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj


def load_optimizer_state(adapter_dir: Path) -> dict | None:
    """The optimizer/scheduler state saved beside an adapter, or None if there is none."""
    path = Path(adapter_dir) / OPTIMIZER_FILE
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several kinds for a bad file
        raise ValueError(f"{path}: cannot read the optimizer state ({e})") from e
