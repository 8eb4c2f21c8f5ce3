"""An inference request's state as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from coserve.scheduler.pooling_params import PoolingParams
from coserve.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One generation request.

    There is no prefill or decode phase: ``num_computed_tokens`` catches up with
    ``num_tokens`` (prompt plus outputs so far), and whenever it reaches it a new
    token is sampled.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None  # LoRA adapter name, None = the bare base model
    eos_token_ids: frozenset[int]  # tokens that end the sequence unless params.ignore_eos
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    error: str | None = None  # why, when the iteration that ran it failed ("error")
    num_preemptions: int = 0
    first_token_time: float | None = None  # when the first output token was sampled (the scheduler's clock)
    tenant: str = "default"  # who asked: the Virtual Token Counter shares the engine fairly among tenants
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs of prompt tokens 1.. (params.prompt_logprobs)
    cache_salt: str = ""  # what its K/V depend on besides its tokens (tenant, adapter): prefix caching's salt
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of its first full blocks (tokens known)
    num_registered_blocks: int = 0  # its first blocks already registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first admitted
    priority: int = 0  # under the priority scheduling policy: lower goes first (vLLM's); ignored by fcfs
    pooling: PoolingParams | None = None  # an embedding request: its prompt's last hidden state is its output (it
    #   ends when the prompt is computed, with no token sampled)
    embedding: list[float] | None = None  # an embedding request's result, once its prompt is computed
    long_rope: bool = False  # its tokens are more than the model's LongRoPE original context: every one of them
    #   rotates by the long factors (``SchedulerConfig.long_rope_from``), and its blocks' prefix-cache keys say so

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known tokens ``[start, end)`` of prompt followed by outputs."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
