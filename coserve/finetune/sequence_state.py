"""What one finetuning sequence keeps between its forward windows and its backward windows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from coserve.model.rope import sequence_rows

IGNORE_INDEX = -100  # a position without a loss target


@dataclass(slots=True)
class SequenceState:
    """Per-sequence tensors of token-level finetuning (the ``--rematerialize all`` keep set).

    Forward windows fill ``layer_inputs`` and ``k``/``v`` for their tokens and the gradient
    of the loss at the last layer's output; backward windows then walk layers from the last
    to the first and, within a layer, windows from the end of the sequence to its start.
    """

    token_ids: torch.Tensor  # [N] long
    targets: torch.Tensor  # [N] long: the next token each position predicts, or IGNORE_INDEX
    positions: torch.Tensor  # [N] long: each token's row of the rotary tables (``sequence_rows``; dropout's too)
    layer_inputs: list[torch.Tensor]  # per layer [N, H]: the layer's input (kept)
    k: list[torch.Tensor]  # per layer [N, Hkv, D]: post-RoPE keys (kept)
    v: list[torch.Tensor]  # per layer [N, Hkv, D]: values (kept)
    grad: torch.Tensor  # [N, H]: dL/d(output of the layer being back-propagated), then of its input
    dk: torch.Tensor  # [N, Hkv, D]: dL/dK accumulated from later windows of the current backward layer
    dv: torch.Tensor  # [N, Hkv, D]: likewise for V
    forward_done: int = 0  # tokens through the forward pass
    backward_layer: int = -1  # the layer being back-propagated (set when the forward finishes)
    backward_end: int = 0  # tokens [0, backward_end) of backward_layer still to back-propagate
    loss_sum: float = 0.0  # the sequence's (scaled) loss so far
    correct: int = 0  # target tokens so far that were their row's most likely token
    window_log: list[tuple[str, int, int, int]] = field(default_factory=list)  # (kind, layer, start, end)
    keeps: list | None = None  # per layer LayerKeep under --rematerialize cheap (pruned_layer.py), else None
    dropout_seed: int = 0  # this sequence's LoRA dropout masks (one per job seed, step and sequence)
    eval_only: bool = False  # a validation sequence: forward windows only, no dropout, no gradient
    rows_positions: tuple[int, int, torch.Tensor] | None = None  # (a, b, positions[a:b]) of the last window

    def positions_of(self, a: int, b: int) -> torch.Tensor:
        """``positions[a:b]``, the same tensor object while windows keep to the same rows (a backward slice's
        whole-layer windows): the rotary embedding's tables of the last call are then reused for it."""
        last = self.rows_positions
        if last is None or last[0] != a or last[1] != b:
            last = self.rows_positions = (a, b, self.positions[a:b])
        return last[2]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    @property
    def forward_finished(self) -> bool:
        return self.forward_done == self.num_tokens

    @property
    def finished(self) -> bool:
        return self.forward_finished and self.backward_layer < 0

    def kept_bytes(self) -> int:
        """Bytes kept between forward and backward: every layer's input and K/V, and the head's gradient."""
        kept = self.layer_inputs + self.k + self.v + [self.grad]
        for keep in self.keeps or ():
            kept += keep.tensors()
        return sum(t.numel() * t.element_size() for t in kept)


def new_sequence_state(token_ids: list[int], targets: list[int], num_layers: int, hidden: int,
                       num_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
                       long_rope_from: int | None = None) -> SequenceState:
    """Allocate the state of one training sequence; ``targets[t]`` is what position ``t`` predicts;
    ``long_rope_from``: the model's LongRoPE original context where its rotary tables have long rows
    (``DecoderModel.long_rope_from``)."""
    n = len(token_ids)
    if n == 0 or len(targets) != n:
        raise ValueError(f"a sequence needs tokens and one target per token, got {n} and {len(targets)}")

    def empty(*shape):  # written by the forward windows before anything reads it
        return torch.empty(*shape, device=device, dtype=dtype)

    def zeros(*shape):  # accumulators
        return torch.zeros(*shape, device=device, dtype=dtype)

    return SequenceState(
        token_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        positions=sequence_rows(n, long_rope_from, device),
        layer_inputs=[empty(n, hidden) for _ in range(num_layers)],
        k=[empty(n, num_kv_heads, head_dim) for _ in range(num_layers)],
        v=[empty(n, num_kv_heads, head_dim) for _ in range(num_layers)],
        grad=empty(n, hidden), dk=zeros(n, num_kv_heads, head_dim), dv=zeros(n, num_kv_heads, head_dim))
