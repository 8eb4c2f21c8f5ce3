"""GRPO (Group Relative Policy Optimization; Shao et al. 2024, as TRL's ``GRPOTrainer`` computes it) on the
finetuning job's windows.

A step samples ``num_generations`` completions for each of its prompts from the adapter as it stands (the
rollouts: ``coserve/engine/grpo_run.py``), scores them with reward functions, and turns each completion's reward
into an advantage relative to its group (``group_advantages``). With one optimization pass per generation (TRL's
``num_iterations`` 1) and no reference model (``beta`` 0, TRL's default), the importance ratio is 1 at the
parameters the completions were sampled from, so the gradient of TRL's loss is the gradient of
``-sum_i s_i * log p(completion_i)``: a weighted cross-entropy on the sampled tokens, whose weights
(``sequence_scales``) carry the advantage and the loss type's normalisation. ``GRPOStepJob`` is one optimizer step of
that weighted cross-entropy, run as any finetuning job's windows are (interleaved with inference by the engine),
continuing the optimizer and schedule of the step before it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

from coserve.finetune.checkpoint import CheckpointSnapshot
from coserve.finetune.config import GRPO_LOSSES, SCALE_REWARDS, FinetuneConfig
from coserve.finetune.job import Example, FinetuneJob
from coserve.finetune.sequence_state import IGNORE_INDEX
from coserve.model.decoder import DecoderModel
from coserve.peft.trainable import TrainableBypass

STD_EPS = 1e-4  # TRL adds it to the standard deviation the advantages are divided by


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def sample_std(xs: list[float]) -> float:
    """The sample standard deviation (torch.std's default, which TRL takes): nan for one value, as torch's (the
    config refuses groups of one unless rewards are not scaled)."""
    if len(xs) < 2:
        return float("nan")
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def group_advantages(rewards: list[float], group: int, scale: str = "group") -> list[float]:
    """Each completion's reward minus its group's mean (groups: consecutive runs of ``group``), divided by the
    group's (``scale`` group) or the whole batch's (batch) reward standard deviation plus ``STD_EPS``, or not (none)."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards: {scale!r} is not one of {', '.join(SCALE_REWARDS)}")
    if not rewards or len(rewards) % group:
        raise ValueError(f"rewards: {len(rewards)} is not a whole number of groups of {group}")
    batch_std = sample_std(rewards) if scale == "batch" else 0.0
    out = []
    for g in range(0, len(rewards), group):
        chunk = rewards[g:g + group]
        mean = _mean(chunk)
        div = {"group": sample_std(chunk) + STD_EPS, "batch": batch_std + STD_EPS, "none": 1.0}[scale]
        out += [(r - mean) / div for r in chunk]
    return out


def sequence_scales(advantages: list[float], completion_tokens: list[int], loss_type: str, batch_size: int,
                    max_completion_tokens: int) -> list[float]:
    """``s_i`` such that the step's loss has the gradient of ``-sum_i s_i * sum_t log p(token_it)``, per TRL's loss
    types, for the ``N`` completions of a step in order (micro-batches of ``batch_size`` in turn, ``M`` of them):

    - ``grpo``: each completion's token mean, then the mean over completions: ``A_i / (T_i N)``;
    - ``bnpo``: a micro-batch's token mean, then the mean over the step's micro-batches: ``A_i / (T_mb M)``;
    - ``dr_grpo``: token sums over a fixed length (Dr. GRPO): ``A_i / (N max_completion_tokens)``;
    - ``dapo``: the token mean over the whole step: ``A_i / sum_j T_j``.
    """
    if loss_type not in GRPO_LOSSES:
        raise ValueError(f"grpo_loss: {loss_type!r} is not one of {', '.join(GRPO_LOSSES)}")
    n = len(advantages)
    if not n or n != len(completion_tokens):
        raise ValueError(f"sequence_scales: {n} advantages for {len(completion_tokens)} completions")
    if loss_type == "grpo":
        return [a / (max(1, t) * n) for a, t in zip(advantages, completion_tokens)]
    if loss_type == "dr_grpo":
        return [a / (n * max_completion_tokens) for a in advantages]
    if loss_type == "dapo":
        total = max(1, sum(completion_tokens))
        return [a / total for a in advantages]
    micro = math.ceil(n / batch_size)
    scales = []
    for k in range(0, n, batch_size):
        tokens = max(1, sum(completion_tokens[k:k + batch_size]))
        scales += [a / (tokens * micro) for a in advantages[k:k + batch_size]]
    return scales


def completion_example(prompt_ids: list[int], completion_ids: list[int]) -> Example:
    """A prompt and a sampled completion as one training sequence whose loss tokens are the completion's."""
    if not completion_ids:
        raise ValueError("completion_ids: a completion has at least one token")
    ids = list(prompt_ids) + list(completion_ids)
    targets = [IGNORE_INDEX] * (len(prompt_ids) - 1) + list(completion_ids) + [IGNORE_INDEX]
    return Example(ids, targets)


class GRPOStepJob(FinetuneJob):
    """One optimizer step over one generation batch: the completions in their sampled order (no shuffle: the
    step's mini-batch is all of them, an epoch of one step), each sequence's cross-entropy scaled by its ``scales``
    entry; after ``previous`` (the step before, whose optimizer, schedule and counters it continues), or the first
    step. ``total_steps``: the run's, for the schedule."""

    def __init__(self, model: DecoderModel, bypass: TrainableBypass, examples: list[Example], scales: list[float],
                 cfg: FinetuneConfig, total_steps: int, previous: GRPOStepJob | None = None,
                 base_model: str = "", resume_from: Path | None = None) -> None:
        """``resume_from``: a checkpoint of the run (its optimizer, schedule and step), for its first step after a
        restart; ``previous`` otherwise."""
        if len(scales) != len(examples):
            raise ValueError(f"scales: {len(scales)} for {len(examples)} completions")
        if previous is not None and resume_from is not None:
            raise ValueError("resume_from: a step continues either the step before or a checkpoint, not both")
        step_cfg = dataclasses.replace(cfg, shuffle=False, max_steps=total_steps, epochs=1)
        super().__init__(model, bypass, examples, step_cfg, base_model, resume_from=resume_from)
        self.scales = list(scales)
        # the run's log lines of this step ({log file: text}), written atomically with its checkpoint, so that a
        # crash leaves the step's state and its records together or neither
        self.step_logs: Callable[[], dict[str, str]] | None = None
        if previous is not None:
            self.optimizer, self.scheduler = previous.optimizer, previous.scheduler
            self.step, self.tokens_done = previous.step, previous.tokens_done
            self.tokens_at_step = previous.tokens_at_step
            self._start = previous._start
        self.stop_at = self.step + 1

    @property
    def done(self) -> bool:
        return self.step >= self.stop_at and self._pending is None

    def snapshot(self) -> CheckpointSnapshot:
        snap = super().snapshot()
        if self.step_logs is None or self.step < self.stop_at:
            return snap
        return dataclasses.replace(snap, logs=self.step_logs())

    def _loss_scale(self) -> float:
        if self._seq.eval_only:
            return super()._loss_scale()
        return self.scales[self._batch[self._next_in_batch - 1]]

