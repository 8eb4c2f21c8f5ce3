"""The hybrid token scheduler's finetuning slice (FlexLLM §6.2): the most finetuning work that keeps
the iteration's predicted latency within the inference SLO.

Pure Python: the inference part of the iteration is described by an ``IterationShape``; the
finetuning slice grows it. Without a latency model, a token budget stands in for the SLO.
"""

from __future__ import annotations

from dataclasses import replace

from coserve.scheduler.finetune_work import BACKWARD, FORWARD, FinetuneProgress, FinetuneWork
from coserve.scheduler.latency_model import IterationShape, LatencyModel
from coserve.scheduler.plan import InferenceChunk


_CONTEXT = {"finetune_forward_tokens": "finetune_forward_context",
            "finetune_backward_token_layers": "finetune_backward_context"}


def inference_shape(chunks: list[InferenceChunk]) -> IterationShape:
    """The token mix of an iteration's inference chunks (decode = a one-token chunk after the prompt)."""
    counts = {"decode_tokens": 0, "decode_context": 0, "prefill_tokens": 0, "prefill_context": 0}
    for c in chunks:
        n = len(c.token_ids)
        if n == 1 and c.start > 0:
            counts["decode_tokens"] += 1
            counts["decode_context"] += c.end
        else:
            counts["prefill_tokens"] += n
            counts["prefill_context"] += n * c.start + n * (n + 1) // 2
    return IterationShape(**counts)


def layer_windows(token_layers: int, pending: int, sequence_tokens: int) -> int:
    """Per-layer backward windows that ``token_layers`` take when ``pending`` tokens are left in the current
    layer and each further layer has ``sequence_tokens``."""
    if token_layers <= 0:
        return 0
    return 1 + -(-max(0, token_layers - pending) // max(1, sequence_tokens))


def backward_windows(job: FinetuneProgress):
    """``n -> `` how many per-layer backward windows ``n`` token-layers of ``job`` take from its position."""
    return lambda n: layer_windows(n, job.pending_tokens, job.sequence_tokens)


def plan_slices(jobs: list[FinetuneProgress], shape: IterationShape, latency: LatencyModel | None,
                budget_s: float, token_budget: int, min_window: int = 1) -> tuple[list[FinetuneWork], IterationShape]:
    """Finetuning work for one iteration, jobs in the given (fairness) order, and the iteration's shape.

    At most one forward window (it rides in the inference forward call); backward windows of any
    jobs after it. With a latency model, each slice is the largest that keeps ``predict(shape)``
    within ``budget_s``; without one, finetuning tokens fill ``token_budget`` (what inference left
    of the iteration's token budget). Slices smaller than ``min_window`` are not scheduled unless
    they finish what the job has pending.
    """
    work: list[FinetuneWork] = []
    tokens_left = token_budget
    has_forward = False
    for job in jobs:
        if job.phase == FORWARD and not has_forward:
            field, limit = "finetune_forward_tokens", job.pending_tokens
            ctx = job.forward_done + min(job.pending_tokens, 256) // 2
        elif job.phase == BACKWARD:
            field, limit = "finetune_backward_token_layers", job.backward_token_layers_left
            ctx = job.sequence_tokens // 2
        else:
            continue
        windows = backward_windows(job) if job.phase == BACKWARD else None
        if latency is not None:
            n = latency.max_tokens_within(shape, budget_s, field, ctx, max_n=limit, windows_of=windows)
        else:
            n = min(limit, tokens_left)
        if n <= 0 or (n < min_window and n < limit):
            continue
        context_field = _CONTEXT[field]
        shape = replace(shape, **{field: getattr(shape, field) + n,
                                  context_field: getattr(shape, context_field) + n * ctx})
        if windows is not None:
            shape = replace(shape, finetune_backward_windows=shape.finetune_backward_windows + windows(n))
        has_forward = has_forward or job.phase == FORWARD
        tokens_left -= n
        work.append(FinetuneWork(job.job_id, job.phase, n))
    return work, shape
