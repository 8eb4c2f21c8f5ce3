"""Finetuning work as the scheduler sees it: a job's position and one iteration's slice. Plain data."""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, DONE = "forward", "backward", "done"


@dataclass(slots=True)
class FinetuneProgress:
    """Where a finetuning job stands; the executor reports it after every iteration that touched the job."""

    job_id: str
    phase: str  # FORWARD or BACKWARD (of the current sequence), or DONE
    pending_tokens: int  # what the next window may cover: the rest of the forward pass, or of the backward layer
    forward_done: int  # tokens of the current sequence already through the forward pass
    backward_layers_left: int  # layers still to back-propagate, the current one included (0 in FORWARD)
    sequence_tokens: int  # tokens of the current sequence
    num_layers: int  # of the model
    tokens_done: int = 0  # tokens through forward and backward so far (the job's throughput counter)

    @property
    def backward_token_layers_left(self) -> int:
        """Token-layers of backward work left in the current sequence."""
        if self.phase != BACKWARD:
            return 0
        return self.pending_tokens + max(0, self.backward_layers_left - 1) * self.sequence_tokens


@dataclass(slots=True)
class FinetuneWork:
    """One job's share of an iteration."""

    job_id: str
    kind: str  # FORWARD: a forward window riding in the inference forward; BACKWARD: backward windows after it
    num_tokens: int  # FORWARD: window tokens; BACKWARD: token-layers (windows run layer after layer)
