"""A finetuning job: mini-batches of sequences, each a series of window calls, then an optimizer step."""

from __future__ import annotations

import json
import math
import random
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from coserve.finetune.checkpoint import (CHECKPOINT_PREFIX, LOG_FILE, CheckpointSnapshot, load_optimizer_state,
                                        snapshot_checkpoint, write_checkpoint)
from coserve.finetune.config import FinetuneConfig
from coserve.finetune.optim import make_optimizer, make_scheduler
from coserve.finetune.pruned_layer import executor_plan, new_keeps, planned_keeps
from coserve.finetune.sequence_state import IGNORE_INDEX, SequenceState, new_sequence_state
from coserve.finetune.token_windows import FinetuneSlice, backward_window, forward_window
from coserve.model.decoder import DecoderModel
from coserve.peft.dropout import mix_seed
from coserve.peft.trainable import TrainableBypass


class FinetuneError(RuntimeError):
    """A job that cannot go on (e.g. repeated non-finite losses); the last good checkpoint stays."""


@dataclass(slots=True)
class Example:
    """One tokenized training sequence (what ``coserve.finetune.dataset`` yields)."""

    token_ids: list[int]
    targets: list[int]  # the next token each position predicts, or IGNORE_INDEX


@dataclass(slots=True)
class StepRecord:
    """One line of ``training_log.jsonl``."""

    step: int  # optimizer steps done, counting this one
    loss: float  # mean loss per target token of the step's sequences
    lr: float  # learning rate this step used
    tokens: int  # tokens of the step's sequences
    elapsed_s: float  # since the job started
    skipped: bool = False  # the loss or gradient was not finite: no update
    valid_loss: float | None = None  # mean loss per target token of the validation set after this step
    accuracy: float = 0.0  # the step's target tokens that were the model's most likely token, as a fraction
    valid_accuracy: float | None = None  # the same over the validation set after this step
    valid_batch_loss: float | None = None  # mean loss per target token of a validation batch (eval_steps)
    valid_batch_accuracy: float | None = None  # its token accuracy
    reward_accuracy: float | None = None  # DPO: the step's pairs whose chosen completion gained on the rejected one
    reward_margin: float | None = None  # DPO: their mean margin, beta * (chosen's log-ratio - rejected's)


class FinetuneJob:
    """Trains ``bypass`` over ``examples``; every window is one call the engine may interleave.

    ``next_work()`` says what comes next ("forward" or "backward" of the current sequence);
    ``forward(n)`` / ``backward(n)`` run one window of up to ``n`` tokens. After the last
    backward window of a mini-batch's last sequence, the optimizer steps. With ``validation``
    examples, the step that ends an epoch (and the last step) is followed by forward windows
    over every validation sequence (no dropout, no gradient); that step's record, with its
    ``valid_loss``, is published (log, ``on_step``) once they are done.
    """

    def __init__(self, model: DecoderModel, bypass: TrainableBypass, examples: list, cfg: FinetuneConfig,
                 base_model: str = "", resume_from: Path | None = None, validation: list | None = None) -> None:
        if not examples:
            raise ValueError("examples: the job has no training examples")
        self.model, self.bypass, self.cfg, self.base_model = model, bypass, cfg, base_model
        self.examples = [Example(list(e.token_ids), list(e.targets)) for e in examples]
        self.validation = [Example(list(e.token_ids), list(e.targets)) for e in validation or ()]
        longest = self.longest_tokens
        if longest > model.rope.max_positions:
            raise ValueError(f"examples: a sequence has {longest} tokens; the model was loaded with positions "
                             f"for {model.rope.max_positions} (lower max_seq_len or load it with more)")
        self.per_step = cfg.batch_size * cfg.grad_accum
        self.steps_per_epoch = math.ceil(self.num_units / self.per_step)
        self.total_steps = cfg.max_steps or self.steps_per_epoch * cfg.epochs
        self.optimizer = make_optimizer(bypass.parameters(), cfg)
        self.scheduler = make_scheduler(self.optimizer, cfg, self.total_steps)
        self.step = 0
        self.tokens_done = 0  # tokens through forward and backward, for throughput
        self.tokens_at_step = 0  # tokens_done when the last optimizer step was taken (what a checkpoint holds)
        self._restored: dict = {}  # what a subclass saved beside the optimizer state (checkpoint_extra), resumed
        if resume_from is not None:
            self._resume(resume_from)
        self.output_dir = Path(cfg.output_dir)
        self.log: list[StepRecord] = []
        self.nonfinite_in_a_row = 0
        self._batch: list[int] = []  # example indices of the current optimizer step
        self._seq: SequenceState | None = None
        self._next_in_batch = 0
        self._batch_loss = 0.0
        self._batch_targets = 0  # target tokens of the step's sequences
        self._batch_correct = 0  # of which predicted right (at the forward, before this step's update)
        self._pending: StepRecord | None = None  # a step waiting for its validation loss
        self._epoch_order: tuple[int, list[int]] | None = None  # (epoch, its order of the examples)
        self._eval_queue: list[int] = []  # validation sequences still to run for it
        self._eval_whole = True  # the queue is the whole validation set (else a batch of it: eval_steps)
        self._eval_loss = 0.0
        self._eval_correct = 0
        self._eval_targets = 0  # target tokens of the queued validation sequences
        self._start = time.perf_counter()
        self.kept_bytes_per_token = 0.0  # what the executor keeps between forward and backward, per token
        self.plan = executor_plan(model, bypass.config, cfg.rematerialize, cfg.memory_target, longest)  # what it keeps
        self.on_step: Callable[[FinetuneJob], None] | None = None  # called after every optimizer step (checkpoints)
        self.write_later: Callable[[Callable[[], None]], None] | None = None  # runs a checkpoint write elsewhere

    # ---- the work interface ------------------------------------------------
    @property
    def done(self) -> bool:
        return self.step >= self.total_steps and self._pending is None

    @property
    def longest_tokens(self) -> int:
        """The longest sequence the job runs (training or validation)."""
        return max(len(e.token_ids) for e in [*self.examples, *self.validation])

    @property
    def held_tokens(self) -> int:
        """The most tokens whose activations the job keeps at once (one sequence in flight: the longest)."""
        return self.longest_tokens

    @property
    def num_units(self) -> int:
        """What a mini-batch counts and an epoch orders: training sequences."""
        return len(self.examples)

    def next_work(self) -> str | None:
        """``"forward"``, ``"backward"`` or None when the job is done."""
        if self.done:
            return None
        if self._seq is None:
            if self._eval_queue:
                self._start_eval_sequence()
            else:
                self._start_sequence()
        return "forward" if not self._seq.forward_finished else "backward"

    def pending_tokens(self) -> int:
        """Tokens the next window may cover at most (the rest of this forward pass or backward layer)."""
        kind = self.next_work()
        if kind is None:
            return 0
        return self._seq.num_tokens - self._seq.forward_done if kind == "forward" else self._seq.backward_end

    def forward(self, num_tokens: int) -> float:
        """One forward window of up to ``num_tokens`` tokens through every layer; returns its scaled loss."""
        if self.next_work() != "forward":
            raise ValueError("forward: the current sequence is not in its forward phase")
        loss = forward_window(self.model, self._window_bypass(), self._seq, num_tokens, self._loss_scale())
        self._account_forward(loss)
        return loss

    def forward_slice(self, num_tokens: int) -> FinetuneSlice:
        """The next forward window, for an engine to run inside its own forward call (``mixed_forward``).

        The caller runs it, then hands the window's loss to ``forward_ran``.
        """
        if self.next_work() != "forward":
            raise ValueError("forward_slice: the current sequence is not in its forward phase")
        return FinetuneSlice(self._window_bypass(), self._seq, num_tokens, self._loss_scale())

    def forward_ran(self, loss: float) -> None:
        """Account the loss of a window run from ``forward_slice``."""
        self._account_forward(loss)

    def _account_forward(self, loss: float) -> None:
        seq = self._seq
        if not seq.eval_only:
            self._batch_loss += loss
            if seq.forward_finished:
                self._batch_correct += seq.correct
            return
        self._eval_loss += loss
        if seq.forward_finished:
            self._eval_correct += seq.correct
            self._seq = None
            if not self._eval_queue:
                self._finish_validation()

    def _finish_validation(self) -> None:
        """The validation pass after a step is done: the step's record is published with its validation loss."""
        record, self._pending = self._pending, None
        accuracy = self._eval_correct / max(1, self._eval_targets)
        if self._eval_whole:
            record.valid_loss, record.valid_accuracy = self._eval_loss, accuracy
        else:
            record.valid_batch_loss, record.valid_batch_accuracy = self._eval_loss, accuracy
        self._publish(record)

    def stop_validation(self) -> None:
        """Publish a step whose validation pass is under way without its validation loss (the job is being
        paused: the step is done, and a resume goes on after it)."""
        if self._pending is None:
            return
        record, self._pending = self._pending, None
        self._eval_queue = []
        if self._seq is not None and self._seq.eval_only:
            self._seq = None
        self._publish(record)

    def position(self) -> tuple[str, int, int, int, int]:
        """``(phase, pending tokens, forward tokens done, backward layers left, sequence tokens)``; phase "done" at the end."""
        kind = self.next_work()
        if kind is None:
            return "done", 0, 0, 0, 0
        seq = self._seq
        layers_left = seq.backward_layer + 1 if kind == "backward" else 0
        return kind, self.pending_tokens(), seq.forward_done, layers_left, seq.num_tokens

    def backward_token_layers(self, token_layers: int, stop: Callable[[], bool] | None = None) -> bool:
        """Backward windows over up to ``token_layers`` token-layers from the current position, each at most
        the rest of its layer, layer after layer; stops early when the sequence's backward pass ends, or, after
        the first window, before the next once ``stop()`` says so (returns True then: the rest is left for a
        later iteration; the first window always runs, so that arrivals however frequent cannot starve the job)."""
        first = True
        while token_layers > 0 and self.next_work() == "backward":
            if not first and stop is not None and stop():
                return True
            n = min(token_layers, self.pending_tokens())
            self.backward(n)
            token_layers -= n
            first = False
        return False

    def backward(self, num_tokens: int) -> None:
        """One backward window of up to ``num_tokens`` tokens of the current layer."""
        if self.next_work() != "backward":
            raise ValueError("backward: the current sequence is not in its backward phase")
        backward_window(self.model, self.bypass, self._seq, num_tokens)
        if self._seq.finished:
            self.tokens_done += self._seq.num_tokens
            self.kept_bytes_per_token = self._seq.kept_bytes() / self._seq.num_tokens
            self._seq = None
            if self._batch_finished():
                self._optimizer_step()

    # ---- internals -----------------------------------------------------------
    def _window_bypass(self):
        """The bypass the current sequence's forward windows run through."""
        return self.bypass

    def _batch_finished(self) -> bool:
        """Whether the sequence whose backward pass just ended was the mini-batch's last."""
        return self._next_in_batch == len(self._batch)

    def _order(self, epoch: int) -> list[int]:
        """The epoch's order of the examples (shuffled once per epoch, not at every step: with small batches the
        shuffle of a large dataset cost more than a step of a small model)."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = list(range(self.num_units))
            if self.cfg.shuffle:
                random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def _start_sequence(self) -> None:
        if self._next_in_batch == len(self._batch):  # a new optimizer step: pick its sequences
            epoch, offset = divmod(self.step, self.steps_per_epoch)
            order = self._order(epoch)
            self._batch = order[offset * self.per_step:(offset + 1) * self.per_step]
            self._next_in_batch = 0
            self._batch_loss = 0.0
            self._batch_targets = target_tokens(self.examples[i] for i in self._batch)
            self._batch_correct = 0
        ex = self.examples[self._batch[self._next_in_batch]]
        self._next_in_batch += 1
        self._seq = self._sequence(ex)
        self._seq.dropout_seed = mix_seed(self.cfg.seed, self.step, self._next_in_batch)
        if self.cfg.rematerialize == "cheap":
            self._seq.keeps = new_keeps(self.model, len(ex.token_ids), planned_keeps(self.plan))

    def _start_eval_sequence(self) -> None:
        self._seq = self._sequence(self.validation[self._eval_queue.pop(0)])
        self._seq.eval_only = True

    def _sequence(self, ex: Example) -> SequenceState:
        c = self.model.cfg
        return new_sequence_state(ex.token_ids, ex.targets, c.num_layers, c.hidden_size, c.num_kv_heads,
                                  c.head_dim, self.model.device, self.model.dtype, self.model.long_rope_from)

    def _loss_scale(self) -> float:
        """Losses are means per target token: of the step's sequences, or of the queued validation sequences."""
        return 1.0 / max(1, self._eval_targets if self._seq.eval_only else self._batch_targets)

    def _optimizer_step(self) -> None:
        params = self.bypass.parameters()
        lr = self.optimizer.param_groups[0]["lr"]
        grads = [p.grad for p in params if p.grad is not None]
        finite = math.isfinite(self._batch_loss) and (  # one device sync for every gradient, not one each
            not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()))
        if finite:
            if self.cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
            self.optimizer.step()
            self.nonfinite_in_a_row = 0
        else:
            self.nonfinite_in_a_row += 1
        with warnings.catch_warnings():  # a skipped step still counts: lr stays the schedule's at ``step``
            if not finite:  # (torch warns when no optimizer step has run yet, as if the order were wrong)
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`", UserWarning)
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_at_step = self.tokens_done
        record = self._step_record(lr, finite)
        if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
            self.log.append(record)
            self._append_log(record)
            raise FinetuneError(f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or "
                                f"gradient (last at step {self.step}); stopping, the last saved adapter is kept")
        queue = self._validation_after_step()
        if queue:
            self._pending = record  # published with its validation loss
            self._eval_queue = queue
            self._eval_loss, self._eval_correct = 0.0, 0
            self._eval_targets = self._validation_targets(queue)
        else:
            self._publish(record)

    def _step_record(self, lr: float, finite: bool) -> StepRecord:
        """The log line of the optimizer step just taken."""
        tokens = sum(len(self.examples[i].token_ids) for i in self._batch)
        return StepRecord(self.step, self._batch_loss, lr, tokens, time.perf_counter() - self._start,
                          skipped=not finite, accuracy=self._batch_correct / max(1, self._batch_targets))

    @property
    def num_validation_units(self) -> int:
        """What a validation pass counts: validation sequences."""
        return len(self.validation)

    def _validation_targets(self, queue: list[int]) -> int:
        """Target tokens of the validation units in ``queue``."""
        return target_tokens(self.validation[i] for i in queue)

    def _validation_after_step(self) -> list[int]:
        """The validation units to run after this step: all of them after an epoch's (and the last) step,
        the next batch every ``eval_steps`` steps, else none."""
        n = self.num_validation_units
        if not n:
            return []
        self._eval_whole = self.step % self.steps_per_epoch == 0 or self.step >= self.total_steps
        if self._eval_whole:
            return list(range(n))
        if self.cfg.eval_steps and self.step % self.cfg.eval_steps == 0:  # the step fixes the batch (a resume too)
            start = (self.step // self.cfg.eval_steps - 1) * self.per_step
            return [(start + i) % n for i in range(min(self.per_step, n))]
        return []

    def _publish(self, record: StepRecord) -> None:
        """A finished step into the log and the training log file, then ``on_step`` (checkpoints)."""
        self.log.append(record)
        self._append_log(record)
        if self.cfg.save_steps and self.step % self.cfg.save_steps == 0 and self.step < self.total_steps:
            self._save_numbered()
        if self.on_step is not None:
            self.on_step(self)

    def _save_numbered(self) -> None:
        """``output_dir/checkpoint-STEP`` (HF Trainer's layout: an adapter directory ``--init-adapter`` resumes
        from), the oldest beyond ``save_total_limit`` removed: by ``write_later`` when set (a co-serving engine
        writes off its thread, in order), else here."""
        write = partial(write_numbered, self.output_dir, self.step, self.snapshot(), self.cfg.save_total_limit)
        if self.write_later is not None:
            self.write_later(write)
        else:
            write()

    def _append_log(self, record: StepRecord) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        line = {"step": record.step, "loss": record.loss, "lr": record.lr, "tokens": record.tokens,
                "elapsed_s": round(record.elapsed_s, 6), "mean_token_accuracy": record.accuracy}
        if record.skipped:
            line["skipped"] = "non-finite loss or gradient"
        if record.valid_loss is not None:
            line["valid_loss"] = record.valid_loss
            line["valid_mean_token_accuracy"] = record.valid_accuracy
        if record.valid_batch_loss is not None:
            line["valid_batch_loss"] = record.valid_batch_loss
            line["valid_batch_mean_token_accuracy"] = record.valid_batch_accuracy
        if record.reward_accuracy is not None:
            line["reward_accuracy"] = record.reward_accuracy
            line["reward_margin"] = record.reward_margin
        with open(self.output_dir / LOG_FILE, "a") as f:
            f.write(json.dumps(line) + "\n")

    def save(self, out_dir: Path | None = None) -> None:
        """Write the adapter and optimizer state to ``out_dir`` (default ``output_dir``) atomically."""
        write_checkpoint(out_dir or self.output_dir, self.snapshot())

    def snapshot(self) -> CheckpointSnapshot:
        """The checkpoint as of now, copied out: ``write_checkpoint`` may write it from another thread while
        training goes on (the server does, so that inference does not wait for the disk)."""
        return snapshot_checkpoint(self.bypass, self.optimizer, self.scheduler, self.step, self.tokens_at_step,
                                   self.base_model, {"total_steps": self.total_steps, "config": _plain(self.cfg)},
                                   extra=self.checkpoint_extra())

    def checkpoint_extra(self) -> dict:
        """What a kind of job keeps beside its optimizer state, for its resume (``_restored``); none here."""
        return {}

    def _resume(self, adapter_dir: Path) -> None:
        saved = load_optimizer_state(adapter_dir)
        if saved is None:
            return  # an adapter without optimizer state: start the optimizer afresh
        try:
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"{adapter_dir}: the saved optimizer state does not fit this job ({e})") from e
        self.step = int(saved.get("step", 0))
        self.tokens_done = self.tokens_at_step = int(saved.get("tokens", 0))  # trained before the checkpoint
        self._restored = saved.get("extra") or {}


def target_tokens(examples) -> int:
    """Target tokens of ``examples`` (positions with a loss)."""
    return sum(sum(t != IGNORE_INDEX for t in e.targets) for e in examples)


def _plain(cfg: FinetuneConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__slots__}


def write_numbered(output_dir: Path, step: int, snap: CheckpointSnapshot, keep: int) -> None:
    """Write ``output_dir/checkpoint-STEP`` and remove the oldest numbered checkpoints beyond ``keep`` (0: none)."""
    write_checkpoint(output_dir / f"{CHECKPOINT_PREFIX}{step}", snap)
    if keep:
        numbered = sorted((int(p.name[len(CHECKPOINT_PREFIX):]), p) for p in output_dir.iterdir()
                          if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
                          and p.name[len(CHECKPOINT_PREFIX):].isdigit())
        for _, path in numbered[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
