"""Rotary position embeddings: plain RoPE and Llama-3 frequency scaling, as HF computes them."""

from __future__ import annotations

import math

import torch

from coserve.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """The ``head_dim // 2`` rotation frequencies, float32, scaled per ``rope.rope_type``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept, the middle band blended.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """A cos/sin table for every position up to ``max_positions``, applied by position id."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, head_dim]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        sin = emb.sin()
        half = head_dim // 2
        # sin with its first half negated: ``rotate_half(x) * sin`` is then ``x.roll(half) * sin_signed``, one
        # kernel where rotate_half takes four (two slices, a negation, a cat), and bit for bit the same product
        # (a sign moved between factors is exact)
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(device=device, dtype=dtype)
        self.max_positions = max_positions
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin_signed)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` by their tokens' ``positions`` ``[T]``."""
        return self.rotate(q, positions), self.rotate(k, positions)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate one of ``q`` or ``k`` (``[T, H, D]``) as ``__call__`` does."""
        cos, sin_signed = self.tables(positions)
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed  # HF: x * cos + rotate_half(x) * sin

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_signed)`` ``[T, 1, D]`` of ``positions`` (``sin_signed``: sin with its first half negated);
        the last call's are reused while the same ``positions`` tensor comes back (every layer of one forward
        passes the same one)."""
        last = self._last
        if last is not None and last[0] is positions:
            return last[1], last[2]
        cos, sin_signed = self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)
        self._last = (positions, cos, sin_signed)
        return cos, sin_signed
