"""Scheduler limits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coserve.scheduler.fairness import FairnessWeights


# coserve: inference first, then the largest finetuning slice within the SLO (the hybrid token scheduler);
# inference-only: finetuning jobs wait; finetune-only: inference requests wait while a job has work;
# temporal: one finetuning iteration (a whole sequence, forward and backward) after every
# `temporal_interval` inference iterations; dts: the same with the interval set by dynamic temporal
# sharing (FlexLLM Appendix A). Both baselines run finetuning whenever no request is in the engine.
POLICIES = ("coserve", "inference-only", "finetune-only", "temporal", "dts")
# Which waiting request goes first and which running one is preempted (vLLM's --scheduling-policy): fcfs, by
# arrival (the tail of the running list is preempted); priority, by each request's priority (lower first, then
# arrival; the lowest-priority request not yet scheduled in the iteration is preempted).
SCHEDULING_POLICIES = ("fcfs", "priority")
# The TPOT margin coserve keeps free (fractions of the SLO): at least DEFAULT_SLO_MARGIN, up to DEFAULT_SLO_MARGIN_MAX
# under misses and load. One place for the defaults of the scheduler, the engine, `serve`, `bench` and its runs.
DEFAULT_SLO_MARGIN = 0.1
DEFAULT_SLO_MARGIN_MAX = 0.6
# The most TPOT slack the load margin makes one request bank (SchedulerConfig.load_reserve_s; inf = no cap, the
# margin holds a request for its whole output). Measured on a 2-core Zen 4 EPYC (docs/benchmark-history.md): a 300 ms
# cap trained 2.2x in the server's never-idle load (200 chats of 128 tokens at 2 req/s: 277 and 342 tokens/s against
# 129 and 154), but at the sweep's heavy end (3 req/s) its requests, stretched to the target, met the trace's burst of
# arrivals with little slack: in a slow stretch of the machine 57.8, 87.4 and 59.3% attainment against 94.1, 91.9 and
# 80.7% without the cap (alternated; inference-only 97.0%), over eight runs each 83.4% against 89.8%. The SLO first:
# no cap by default; an operator whose load is steady can set one.
DEFAULT_LOAD_RESERVE_S = math.inf


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_margins(slo_margin, slo_margin_max, load_margin_max) -> None:
    """The SLO margins' checks (``SchedulerConfig`` and ``EngineConfig``): numbers with
    0 <= slo_margin <= load_margin_max (or None) <= slo_margin_max < 1; a ValueError names the field."""
    if not (_number(slo_margin) and 0 <= slo_margin < 1):
        raise ValueError(f"slo_margin must lie in [0, 1), got {slo_margin!r}")
    if not (_number(slo_margin_max) and slo_margin <= slo_margin_max < 1):
        raise ValueError(f"slo_margin_max must lie in [slo_margin, 1), got {slo_margin_max!r}")
    if load_margin_max is not None and not (_number(load_margin_max)
                                            and slo_margin <= load_margin_max <= slo_margin_max):
        raise ValueError(f"load_margin_max must be None or lie in [slo_margin, slo_margin_max], "
                         f"got {load_margin_max!r}")


def check_load_reserve(value, name: str) -> None:
    """A load reserve is a number >= 0 (inf: no cap); a ValueError names the field ``name``."""
    if not (_number(value) and value >= 0):
        raise ValueError(f"{name} must be a number >= 0 (inf: no cap), got {value!r}")


def check_delay_factor(value) -> None:
    """``scheduler_delay_factor`` must be a finite number >= 0 (SchedulerConfig and EngineConfig)."""
    if not (_number(value) and 0 <= value < float("inf")):
        raise ValueError(f"scheduler_delay_factor must be a finite number >= 0, got {value!r}")


@dataclass(slots=True)
class SchedulerConfig:
    """Budgets that bound one iteration; validated on construction."""

    max_num_batched_tokens: int = 2048  # new tokens per iteration, all requests together
    max_num_seqs: int = 128  # requests running at once
    max_model_len: int = 2048  # prompt plus output tokens of one request
    max_loras: int = 4  # distinct adapters among the running requests
    policy: str = "coserve"  # how finetuning shares iterations (POLICIES)
    slo_tpot_s: float = 0.05  # inference time-per-output-token target the finetuning slice respects
    slo_margin: float = DEFAULT_SLO_MARGIN  # fraction of the SLO kept free for prediction error (the least margin)
    slo_margin_max: float = DEFAULT_SLO_MARGIN_MAX  # coserve: the margin rises toward this while finished requests
    #   miss the SLO and falls back while they attain it (``TpotBudget.observe_tpot``), and with the inference load
    #   (``TpotBudget.load_margin``); equal to slo_margin = a fixed margin
    load_margin_max: float | None = None  # coserve: the most the inference load alone raises the margin to (None:
    #   slo_margin_max); below slo_margin_max, only misses of the SLO take the margin above it
    load_reserve_s: float = DEFAULT_LOAD_RESERVE_S  # coserve: the most slack (seconds, against the target without
    #   the load margin) the load margin makes a running request bank; one that has banked it goes at that target
    #   (``TpotBudget.budget_s``). inf = the load margin holds every request for its whole output
    min_finetune_window: int = 16  # smallest finetuning slice worth an iteration (unless it finishes a pass)
    min_prefill_chunk: int = 64  # coserve: the least prompt tokens an iteration takes while requests decode (a
    #   prefill chunk is otherwise cut to what keeps the iteration within their TPOT budget)
    idle_iteration_s: float = 0.2  # with no request in the engine, how long a finetuning-only iteration may be
    #   (the most a newly arrived request waits for the running iteration before its prefill)
    finetune_burst_s: float = 0.0  # coserve: with requests decoding, finetuning runs only in iterations whose TPOT
    #   budget (the slack every decoding request has banked) reaches this many seconds, up to idle_iteration_s
    #   long; the iterations in between decode alone and bank slack. For devices where a finetuning slice costs the
    #   same beside decode tokens as alone and small slices cost more per token (CPUs); 0 = off: every iteration
    #   carries the largest slice within the TPOT target (FlexLLM's hybrid token scheduler)
    first_token_slice_s: float | None = None  # coserve: the most finetuning time (by the latency model) an
    #   iteration that gives a request its first token carries; the time it leaves is banked as the running
    #   requests' TPOT slack (a later burst takes it). None = as any other iteration
    temporal_interval: int = 64  # policy temporal: inference iterations per finetuning iteration
    speculative_tokens: int = 0  # n-gram draft tokens verified per decode step of a greedy request; 0 = off
    scheduling_policy: str = "fcfs"  # SCHEDULING_POLICIES
    scheduler_delay_factor: float = 0.0  # vLLM's: while requests run, new prompts wait until the oldest has waited
    #   this many times the latency of the last iteration that admitted prompts, so that several share one
    #   prefill pass (where a pass costs its kernel launches whatever its tokens); 0 = admit at once
    fairness: FairnessWeights = field(default_factory=FairnessWeights)  # VTC cost of input, output, finetuning tokens
    long_rope_from: int | None = None  # LongRoPE's original context (Phi-3 past it): a request longer than this is
    #   computed with every token rotated by the long factors, and one that grows past it is computed again from
    #   its first token so, as transformers' Phi-3 generate does (``Request.long_rope``)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_loras", "min_finetune_window",
                     "min_prefill_chunk", "temporal_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.speculative_tokens, int) or self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be a non-negative integer, got {self.speculative_tokens!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: {self.scheduling_policy!r} is not one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if not (isinstance(self.slo_tpot_s, (int, float)) and self.slo_tpot_s > 0):
            raise ValueError(f"slo_tpot_s must be positive, got {self.slo_tpot_s!r}")
        if not (isinstance(self.idle_iteration_s, (int, float)) and self.idle_iteration_s > 0):
            raise ValueError(f"idle_iteration_s must be positive, got {self.idle_iteration_s!r}")
        if self.first_token_slice_s is not None and not (
                isinstance(self.first_token_slice_s, (int, float)) and self.first_token_slice_s >= 0):
            raise ValueError(f"first_token_slice_s must be None or a non-negative number of seconds, got "
                             f"{self.first_token_slice_s!r}")
        if not (isinstance(self.finetune_burst_s, (int, float)) and self.finetune_burst_s >= 0):
            raise ValueError(
                f"finetune_burst_s must be a non-negative number of seconds, got {self.finetune_burst_s!r}")
        check_margins(self.slo_margin, self.slo_margin_max, self.load_margin_max)
        check_load_reserve(self.load_reserve_s, "load_reserve_s")
        check_delay_factor(self.scheduler_delay_factor)
