"""How one layer's queries attend to their keys, beyond the causal order: the scores' scale, a sliding window, a
soft cap and sinks. Every attention path (paged inference, finetuning windows and their backward, the autograd
reference) takes one, so that a new kind of layer changes this record and the kernels that read it, not every
caller."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """One layer's attention: ``scale`` multiplies q·k; ``window`` (sliding layers: Mistral, Gemma's local layers)
    lets each query see only the last ``window`` positions, its own included, None its whole context; ``softcap``
    (Gemma 2's ``attn_logit_softcapping``) bends the scaled scores to ``cap * tanh(s / cap)``, None leaves them;
    ``sinks`` (gpt-oss's, one logit per query head) join each query's softmax as a score of no value, so that its
    weights over the keys sum to less than one."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: tuple[float, ...] | None = None

    @property
    def explicit(self) -> bool:
        """Whether this attention runs written out in torch (``explicit_attention``): no fused kernel caps scores
        or has sinks."""
        return self.softcap is not None or self.sinks is not None
