"""A DPO job (Direct Preference Optimization, Rafailov et al. 2023): the finetuning job's windows over preference
pairs, each pair's loss ``-log sigmoid(beta * ((lc - rc) - (lr - rr)))``, where ``lc``/``lr`` are the chosen and
rejected completions' summed log-probabilities under the adapter and ``rc``/``rr`` under the reference: the base
model (the adapter off), or a frozen adapter (``dpo_reference``, e.g. the supervised adapter DPO starts from).

A pair runs as up to six sequences of windows, one at a time, each an ordinary forward or backward pass that the
engine interleaves with inference as it does any job's: the two reference forwards (no gradient; their
log-probabilities are kept per pair, so later epochs, and a job resumed from a checkpoint, skip them), the chosen
and the rejected forward, then the two backward passes. A forward window stores the gradient of its tokens'
cross-entropy (the negated log-probability) at the last layer's output; the loss depends on the pair's
log-probabilities only through their sums, so once both forwards are done the stored gradients are scaled by
``dL/d(-lc)`` and ``dL/d(-lr)``, and the backward passes give the exact gradient of the mini-batch's mean DPO loss.
TRL's hinge and IPO losses, and the sigmoid loss with label smoothing, differ only in that scale (``dpo_terms``). So
do the reference-free methods, which skip the reference forwards: SimPO (``simpo_terms``, on per-token mean
log-probabilities) and ORPO (``orpo_terms``: the odds ratio of the means, plus the chosen completions'
cross-entropy, a token mean over the step, which only adds to the chosen sequence's scale).
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array

import torch

from coserve.finetune.config import FinetuneConfig
from coserve.finetune.job import FinetuneJob, StepRecord, target_tokens
from coserve.finetune.preference import PreferencePair
from coserve.finetune.pruned_layer import new_keeps, planned_keeps
from coserve.model.decoder import DecoderModel
from coserve.peft.dropout import mix_seed
from coserve.peft.trainable import TrainableBypass, load_model_trainable

CHOSEN, REJECTED = "chosen", "rejected"


class NoBypass:
    """The reference model's bypass: none (every module runs as the frozen base)."""

    modules = frozenset()


NO_BYPASS = NoBypass()


def reference_adapter(model: DecoderModel, path: str) -> TrainableBypass:
    """The adapter directory ``path`` as a frozen reference bypass (its forward windows run without dropout)."""
    reference = load_model_trainable(path, model)
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


def _log_sigmoid(x: float) -> float:
    return -(max(-x, 0.0) + math.log1p(math.exp(-abs(x))))  # -softplus(-x), without overflow


def _sigmoid(x: float) -> float:
    e = math.exp(-abs(x))
    return 1.0 / (1.0 + e) if x >= 0 else e / (1.0 + e)


def dpo_terms(beta: float, chosen: float, rejected: float, ref_chosen: float, ref_rejected: float,
              loss_type: str = "sigmoid", label_smoothing: float = 0.0) -> tuple[float, float, float]:
    """``(loss, margin, slope)`` of one pair from its log-probabilities (TRL's ``DPOTrainer`` losses): with ``z =
    (chosen - ref_chosen) - (rejected - ref_rejected)``, ``margin = beta * z`` and ``slope = dloss/dz``:

    - ``sigmoid`` (DPO): ``-(1 - e) log sigmoid(beta z) - e log sigmoid(-beta z)``, ``e`` the label smoothing;
    - ``hinge`` (SLiC): ``max(0, 1 - beta z)``;
    - ``ipo`` (IPO): ``(z - 1 / (2 beta))^2`` (its log-probabilities are per-token means: the caller's part).
    """
    z = (chosen - ref_chosen) - (rejected - ref_rejected)
    margin = beta * z
    if loss_type == "sigmoid":
        eps = label_smoothing
        loss = -(1 - eps) * _log_sigmoid(margin) - eps * _log_sigmoid(-margin)
        slope = beta * (eps * _sigmoid(margin) - (1 - eps) * _sigmoid(-margin))
    elif loss_type == "hinge":
        loss, slope = max(0.0, 1.0 - margin), (-beta if margin < 1.0 else 0.0)
    elif loss_type == "ipo":
        gap = z - 1.0 / (2.0 * beta)
        loss, slope = gap * gap, 2.0 * gap
    else:
        raise ValueError(f"dpo_loss: {loss_type!r} is not one of sigmoid, hinge, ipo")
    return loss, margin, slope


def simpo_terms(beta: float, gamma: float, chosen: float, rejected: float, label_smoothing: float = 0.0
                ) -> tuple[float, float, float]:
    """SimPO's ``(loss, margin, slope)`` from the completions' per-token mean log-probabilities (TRL's CPOTrainer,
    loss_type simpo): ``-(1 - e) log sigmoid(beta d - gamma) - e log sigmoid(gamma - beta d)`` with ``d = chosen -
    rejected``; ``margin = beta d`` (the rewards' difference, as TRL logs it), ``slope = dloss/dd``."""
    loss, _, slope = dpo_terms(beta, chosen, rejected, gamma / beta, 0.0, "sigmoid", label_smoothing)
    return loss, beta * (chosen - rejected), slope


def orpo_terms(beta: float, chosen: float, rejected: float) -> tuple[float, float, float, float]:
    """ORPO's odds-ratio part ``(loss, margin, dloss/dchosen, dloss/drejected)`` from the completions' per-token mean
    log-probabilities (TRL's ORPOTrainer): ``-beta log sigmoid(log_odds)``, ``log_odds = (chosen - rejected) -
    (log(1 - e^chosen) - log(1 - e^rejected))``; ``margin = beta (chosen - rejected)``, as TRL logs it."""
    def log1m_exp(x: float) -> float:  # log(1 - e^x), x <= 0
        return math.log(max(-math.expm1(x), 1e-300))

    log_odds = (chosen - rejected) - (log1m_exp(chosen) - log1m_exp(rejected))
    loss = -beta * _log_sigmoid(log_odds)
    slope = -beta * _sigmoid(-log_odds)  # dloss/dlog_odds
    # d log_odds / d x = 1 / (1 - e^x) for the chosen, minus that for the rejected
    return (loss, beta * (chosen - rejected), slope / max(-math.expm1(chosen), 1e-300),
            -slope / max(-math.expm1(rejected), 1e-300))


class PreferenceJob(FinetuneJob):
    """``FinetuneJob`` over preference pairs with the DPO loss (or SimPO's or ORPO's: ``cfg.method``); mini-batches
    count pairs (``batch_size`` pairs a micro-batch). ``validation`` pairs run as the training job runs validation
    sequences (after each epoch, the last step, and with ``eval_steps``): forward passes only, without dropout, for
    their mean loss."""

    def __init__(self, model: DecoderModel, bypass: TrainableBypass, pairs: list[PreferencePair],
                 cfg: FinetuneConfig, base_model: str = "", resume_from=None,
                 validation: list[PreferencePair] | None = None) -> None:
        if not pairs:
            raise ValueError("examples: the job has no preference pairs")
        flat = [e for p in pairs for e in (p.chosen, p.rejected)]  # pair u: examples 2u and 2u + 1
        held_out = [e for p in validation or () for e in (p.chosen, p.rejected)]
        super().__init__(model, bypass, flat, cfg, base_model, resume_from, held_out)
        self.reference = NO_BYPASS if not cfg.dpo_reference else reference_adapter(model, cfg.dpo_reference)
        self._refs: dict[bool, dict[int, tuple[float, float]]] = {False: {}, True: {}}  # (validation?) -> pair ->
        #   its reference log-probabilities (chosen, rejected)
        self._eval = False  # the current pair is a validation pair
        self._pair = -1
        self._tasks: list[tuple[str, str]] = []  # the current pair's (role, kind) still to run
        self._role = ""  # the current sequence's: "ref_chosen", "ref_rejected", "chosen" or "rejected"
        self._ref_logps = [0.0, 0.0]  # the current pair's reference log-probabilities as they come
        self._policy: dict[str, tuple] = {}  # role -> (its sequence state, or in validation its target tokens;
        #   its log-probability)
        self._margins: list[float] = []  # of the step's pairs so far
        self._eval_pairs = 0  # pairs of the validation pass under way
        self._batch_chosen_targets = 0  # target tokens of the step's chosen completions (ORPO's cross-entropy)
        self._eval_chosen_targets = 0  # and of the validation pass's
        # what the cached reference log-probabilities depend on, computed here rather than at the first checkpoint
        # (which the engine thread writes): (validation?) -> fingerprint
        self._fingerprints = {e: self._fingerprint(e) for e in (False, True)} if cfg.method == "dpo" else {}
        for evaluating, saved in ((False, self._restored.get("reference_logps")),
                                  (True, self._restored.get("validation_reference_logps"))):
            if saved and cfg.method == "dpo" and saved.get("fingerprint") == self._fingerprints[evaluating]:
                self._refs[evaluating] = dict(saved["pairs"])  # of the same pairs, under the same reference
        self._restored = {}

    def checkpoint_extra(self) -> dict:
        """The pairs' reference log-probabilities: a resumed job does not run those forwards again."""
        if self.cfg.method != "dpo":
            return {}
        return {"reference_logps": {"fingerprint": self._fingerprints[False], "pairs": dict(self._refs[False])},
                "validation_reference_logps": {"fingerprint": self._fingerprints[True],
                                               "pairs": dict(self._refs[True])}}

    def _fingerprint(self, evaluating: bool) -> str:
        """What the cached reference log-probabilities of the training (or validation) pairs depend on: the pairs'
        tokens and targets, the reference adapter's weights and the model's dtype. A resume on other data or
        another reference recomputes them."""
        h = hashlib.sha256(str(self.model.embed.dtype).encode())
        for e in self.validation if evaluating else self.examples:
            h.update(array("q", e.token_ids).tobytes() + b"|" + array("q", e.targets).tobytes() + b";")
        if self.reference is not NO_BYPASS:
            for name, tensor in sorted(self.reference.state_dict().items()):
                h.update(name.encode() + tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
                         .numpy().tobytes())
        return h.hexdigest()

    @property
    def num_units(self) -> int:
        return len(self.examples) // 2

    @property
    def num_validation_units(self) -> int:
        return len(self.validation) // 2

    @property
    def held_tokens(self) -> int:
        """A training pair's chosen and rejected sequences are held together between their forward and backward
        passes (a validation sequence only during its forward pass)."""
        pairs = max(len(self.examples[2 * u].token_ids) + len(self.examples[2 * u + 1].token_ids)
                    for u in range(self.num_units))
        return max(pairs, self.longest_tokens)

    # ---- the pair's sequences ----------------------------------------------------
    def _start_sequence(self) -> None:
        if not self._tasks:
            self._start_pair()
        self._next_task()

    def _start_eval_sequence(self) -> None:
        if not self._tasks:  # the next validation pair (it leaves the queue when its last sequence starts)
            self._eval, self._pair = True, self._eval_queue[0]
            self._tasks = self._ref_tasks() + [(CHOSEN, "forward"), (REJECTED, "forward")]
        self._next_task()
        if not self._tasks:
            self._eval_queue.pop(0)

    def _start_pair(self) -> None:
        if self._next_in_batch == len(self._batch):  # a new optimizer step: pick its pairs
            epoch, offset = divmod(self.step, self.steps_per_epoch)
            self._batch = self._order(epoch)[offset * self.per_step:(offset + 1) * self.per_step]
            self._next_in_batch = 0
            self._batch_loss = 0.0
            self._batch_targets = target_tokens(self.examples[2 * u + k] for u in self._batch for k in (0, 1))
            self._batch_chosen_targets = target_tokens(self.examples[2 * u] for u in self._batch)
            self._batch_correct = 0
            self._margins = []
        self._eval, self._pair = False, self._batch[self._next_in_batch]
        self._next_in_batch += 1
        self._tasks = self._ref_tasks() + [(CHOSEN, "forward"), (REJECTED, "forward"), (CHOSEN, "backward"),
                                           (REJECTED, "backward")]

    def _ref_tasks(self) -> list[tuple[str, str]]:
        """The current pair's reference forwards, unless an earlier epoch (or validation pass) ran them or the method
        has no reference (SimPO, ORPO)."""
        if self.cfg.method != "dpo" or self._pair in self._refs[self._eval]:
            return []
        return [("ref_chosen", "forward"), ("ref_rejected", "forward")]

    def _next_task(self) -> None:
        role, kind = self._tasks.pop(0)
        self._role = role
        if kind == "backward":  # (popped: once its backward ends, nothing holds the sequence's tensors)
            self._seq = self._policy.pop(role)[0]
            return
        source = self.validation if self._eval else self.examples
        example = source[2 * self._pair + role.endswith(REJECTED)]
        self._seq = self._sequence(example)
        if self._eval or role.startswith("ref_"):
            self._seq.eval_only = True  # no dropout, no gradient stored
            return
        self._seq.dropout_seed = mix_seed(self.cfg.seed, self.step, 2 * self._next_in_batch - (role == CHOSEN))
        if self.cfg.rematerialize == "cheap":
            self._seq.keeps = new_keeps(self.model, len(example.token_ids), planned_keeps(self.plan))

    def _window_bypass(self):
        return self.reference if self._role.startswith("ref_") else self.bypass

    def _loss_scale(self) -> float:
        return 1.0  # a sequence's loss is its summed cross-entropy: minus its log-probability

    def _account_forward(self, loss: float) -> None:
        seq = self._seq
        if not seq.forward_finished:
            return
        logp, role = -seq.loss_sum, self._role
        self._seq = None
        if role.startswith("ref_"):
            self._ref_logps[role == "ref_rejected"] = logp
            if role == "ref_rejected":
                self._refs[self._eval][self._pair] = (self._ref_logps[0], self._ref_logps[1])
            return
        if self._eval:
            self._eval_correct += seq.correct
            if role == CHOSEN:
                self._policy[CHOSEN] = (seq.num_targets, logp)
                return
            chosen_targets, lc = self._policy.pop(CHOSEN)
            pair_loss = self._pair_terms(lc, logp, (chosen_targets, seq.num_targets))[0]
            self._eval_loss += pair_loss / max(1, self._eval_pairs)
            if not self._eval_queue:
                self._finish_validation()
            return
        self._policy[role] = (seq, logp)
        self._batch_correct += seq.correct
        if role == REJECTED:
            self._weigh_pair()

    def _pair_terms(self, lc: float, lr: float, counts: tuple[int, int]) -> tuple[float, float, float, float]:
        """``(loss, margin, dL/d lc, dL/d lr)`` of the current pair from its summed log-probabilities (IPO's, SimPO's
        and ORPO's are per-token means: ``counts`` are the two completions' target tokens). ``loss`` is the pair's
        share of the step's (or validation pass's) loss times its number of pairs."""
        cfg = self.cfg
        if cfg.method == "simpo":
            loss, margin, slope = simpo_terms(cfg.dpo_beta, cfg.simpo_gamma, lc / counts[0], lr / counts[1],
                                              cfg.dpo_label_smoothing)
            return loss, margin, slope / counts[0], -slope / counts[1]
        if cfg.method == "orpo":
            pairs, chosen_targets = ((self._eval_pairs, self._eval_chosen_targets) if self._eval
                                     else (len(self._batch), self._batch_chosen_targets))
            nll = pairs / max(1, chosen_targets)  # the cross-entropy is a token mean over the step's chosen completions
            loss, margin, d_chosen, d_rejected = orpo_terms(cfg.dpo_beta, lc / counts[0], lr / counts[1])
            return -lc * nll + loss, margin, -nll + d_chosen / counts[0], d_rejected / counts[1]
        rc, rr = self._refs[self._eval][self._pair]
        scale = (1.0 / counts[0], 1.0 / counts[1]) if cfg.dpo_loss == "ipo" else (1.0, 1.0)
        loss, margin, slope = dpo_terms(cfg.dpo_beta, lc * scale[0], lr * scale[1], rc * scale[0], rr * scale[1],
                                        cfg.dpo_loss, cfg.dpo_label_smoothing)
        return loss, margin, slope * scale[0], -slope * scale[1]

    def _weigh_pair(self) -> None:
        """Both forwards are done: the pair's loss, and its stored head gradients scaled to the DPO loss's."""
        (chosen, lc), (rejected, lr) = self._policy[CHOSEN], self._policy[REJECTED]
        loss, margin, d_chosen, d_rejected = self._pair_terms(lc, lr, (chosen.num_targets, rejected.num_targets))
        n = len(self._batch)  # the step's loss is the mean over its pairs
        chosen.grad.mul_(-d_chosen / n)  # the stored gradients are of the cross-entropy, -lc and -lr
        rejected.grad.mul_(-d_rejected / n)
        self._batch_loss += loss / n
        self._margins.append(margin)

    def _batch_finished(self) -> bool:
        return not self._tasks and self._next_in_batch == len(self._batch)

    def _validation_after_step(self) -> list[int]:
        queue = super()._validation_after_step()
        self._eval_pairs = len(queue)
        return queue

    def _validation_targets(self, queue: list[int]) -> int:
        self._eval_chosen_targets = target_tokens(self.validation[2 * v] for v in queue)
        return target_tokens(self.validation[2 * v + k] for v in queue for k in (0, 1))

    def stop_validation(self) -> None:
        if self._pending is not None and self._eval:  # the validation pair under way is dropped with the pass
            self._tasks, self._policy = [], {}
        super().stop_validation()

    def _step_record(self, lr: float, finite: bool) -> StepRecord:
        tokens = sum(len(self.examples[2 * u + k].token_ids) for u in self._batch for k in (0, 1))
        margins = self._margins
        return StepRecord(self.step, self._batch_loss, lr, tokens, time.perf_counter() - self._start,
                          skipped=not finite, accuracy=self._batch_correct / max(1, self._batch_targets),
                          reward_accuracy=sum(m > 0 for m in margins) / max(1, len(margins)),
                          reward_margin=sum(margins) / max(1, len(margins)))
