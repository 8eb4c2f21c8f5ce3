"""What a finetuning job holds in memory while it is co-served (FlexLLM §7: the finetuning budget).

The adapter's weights, their gradients and the optimizer's state (two moments for AdamW, none for
plain SGD), plus the tensors the graph-pruning plan keeps between a sequence's forward and backward
passes for the most tokens the job holds at once (its longest sequence; a DPO pair's two sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}  # tensors of optimizer state per parameter tensor


@dataclass(slots=True, frozen=True)
class JobMemory:
    """A job's bytes, by part."""

    adapter_bytes: int  # weights, gradients and optimizer state
    activation_bytes: int  # the plan's kept tensors for the job's longest sequence

    @property
    def total_bytes(self) -> int:
        return self.adapter_bytes + self.activation_bytes


def job_memory(job) -> JobMemory:
    """``job``'s memory (a ``FinetuneJob``): exact for the adapter, the plan's bytes for activations."""
    params = job.bypass.parameters()
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    copies = 2 + OPTIMIZER_STATES[job.cfg.optimizer]  # weights, gradients, optimizer state
    return JobMemory(weight_bytes * copies, int(job.plan.model_kept_bytes_per_token * job.held_tokens))
