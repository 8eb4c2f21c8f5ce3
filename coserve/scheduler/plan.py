"""What the scheduler asks of the executor for one iteration, and what comes back. Plain data only."""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.scheduler.finetune_work import FinetuneProgress, FinetuneWork
from coserve.scheduler.latency_model import IterationShape
from coserve.scheduler.pooling_params import PoolingParams
from coserve.scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class InferenceChunk:
    """New tokens of one request to run this iteration."""

    request_id: str  # which request
    start: int  # position of the first new token (the request's num_computed_tokens)
    token_ids: list[int]  # the new tokens themselves, positions start .. start + len - 1
    block_table: list[int]  # the request's KV blocks, covering at least start + len positions
    adapter: str | None  # LoRA adapter applied to these tokens, None = base model
    sample: bool  # whether this chunk reaches the request's last known token: sample the next one
    params: SamplingParams  # how to sample (read only when sample is true)
    num_output_tokens: int  # outputs the request already has (for per-request seeded sampling)
    # (prompt ids, output ids so far) when sampling reads them (``params.reads_history``), else None
    history: tuple[list[int], list[int]] | None = None
    # prompt tokens that this chunk's first rows predict (params.prompt_logprobs): row i scores prompt_targets[i]
    prompt_targets: list[int] | None = None
    # speculative decoding: the chunk's tokens after the first are drafts; every row is scored (greedy) and the
    # drafts the model agrees with are kept, with one more token after them
    num_drafts: int = 0
    # an embedding request's last prompt chunk (with ``sample``): its last row is pooled into the embedding instead
    pooling: PoolingParams | None = None
    long_rope: bool = False  # the request is past LongRoPE's original context (``Request.long_rope``)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(slots=True)
class IterationPlan:
    """The scheduler's decision for one engine iteration."""

    step: int  # iteration counter
    chunks: list[InferenceChunk]  # inference work, decode tokens and prefill chunks alike
    preempted: list[str] = field(default_factory=list)  # requests preempted while planning (blocks freed)
    finished: list[str] = field(default_factory=list)  # requests finished since the last plan
    adapters: list[str] = field(default_factory=list)  # distinct adapters this iteration uses
    num_scheduled_tokens: int = 0  # total new tokens across chunks
    finetune: list[FinetuneWork] = field(default_factory=list)  # finetuning slices: at most one forward
    predicted_s: float = 0.0  # the latency model's estimate of this iteration (0 without a model)
    shape: IterationShape | None = None  # the token mix the finetuning slices were sized for
    window_map: list[tuple[int, int]] = field(default_factory=list)  # (main block, sliding-layer storage) lent while
    #   planning (a model whose sliding layers have a pool of their own: ``kvcache/window_pool.py``)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.finetune


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one sampled position."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability
    top: dict[int, float] = field(default_factory=dict)  # the N most likely tokens and theirs
    rank: int | None = None  # vLLM's: how many tokens are at least as likely (1: the likeliest); None where not scored


@dataclass(slots=True)
class ExecutionResult:
    """The executor's answer to an IterationPlan."""

    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    more_sampled: dict[str, list[int]] = field(default_factory=dict)  # speculative chunks: tokens after the first
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # for requests that asked
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # chunk's prompt_targets scored
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # request id -> its embedding (pooling chunks)
    elapsed_s: float = 0.0  # wall time of the iteration's model work
    finetune: list[FinetuneProgress] = field(default_factory=list)  # jobs the iteration advanced, after it
    finetune_losses: dict[str, float] = field(default_factory=dict)  # job id -> loss of its forward window
    finetune_errors: dict[str, str] = field(default_factory=dict)  # job id -> why it stopped (reported DONE)
    request_errors: dict[str, str] = field(default_factory=dict)  # request id -> why its chunk failed alone (its
    #   forward or its sampling raised; the rest of the iteration stands, the request ends with finish_reason "error")
    forward_error: str | None = None  # the iteration's forward or LM head raised this: its parts ran again apart (the
    #   executor's ``_forward_apart`` and ``_tokens_apart``), and only what raised alone failed
    interrupted: bool = False  # its finetuning slice stopped early for a new request (elapsed_s is not the plan's)
