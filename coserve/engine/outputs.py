"""What generation returns to callers (the vLLM ``RequestOutput`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.scheduler.plan import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while running
    logprobs: list[TokenLogprobs] | None = None  # one per generated token when asked for
    stop_reason: str | int | None = None  # the stop string or token that ended it, if any


@dataclass(slots=True)
class RequestOutput:
    """A request's prompt and its output so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_preemptions: int = 0
    error: str | None = None  # finish_reason "error": what made the iteration running it fail
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then each one's, as far as computed
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (when first admitted)
    embedding: list[float] | None = None  # an embedding request's (``PoolingParams``), once finished

    @property
    def text(self) -> str:
        """The first (only) completion's text."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """The first (only) completion's token ids."""
        return self.outputs[0].token_ids


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""

    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (the vLLM ``EmbeddingRequestOutput`` shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclass(slots=True)
class ScoringOutput:
    """vLLM's: one pair's score (with an embedding model, the cosine similarity of the two texts' embeddings)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (the vLLM ``ScoringRequestOutput`` shape)."""

    request_id: str
    prompt_token_ids: list[int]  # the second text's (the first's embedding may serve several pairs)
    outputs: ScoringOutput
    finished: bool = True
