"""How to turn a prompt into an embedding (the vLLM ``PoolingParams`` shape): the last token's final hidden state,
as vLLM pools a decoder-only model (``LAST`` pooling), cut to ``dimensions`` and L2-normalized."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.scheduler.sampling_params import check_truncate_prompt_tokens


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """An embedding request's settings; validated on construction, errors name the field."""

    dimensions: int | None = None  # OpenAI's: keep the first this many values (renormalized); None = the hidden size
    normalize: bool = True  # vLLM's: divide by the L2 norm (OpenAI's embeddings are unit vectors)
    truncate_prompt_tokens: int | None = None  # vLLM's: embed only the prompt's last k tokens (-1: as many as the
    #   model's context holds); None = the whole prompt

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be None or a positive integer, got {d!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True or False, got {self.normalize!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
