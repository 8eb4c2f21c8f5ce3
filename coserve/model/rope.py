"""Rotary position embeddings: plain RoPE, linear, Llama-3 and YaRN frequency scaling and Phi-3's LongRoPE (its short
factors within the original context, its long ones past it), over all of each head or its first dimensions
(``partial_rotary_factor``), as HF computes them."""

from __future__ import annotations

import math

import torch

from coserve.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """The ``head_dim // 2`` rotation frequencies, float32, scaled per ``rope.rope_type`` (``head_dim``: the rotated
    dimensions, where only part of a head rotates; ``long``: LongRoPE's long factors, else its short ones)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope.rope_type == "longrope":  # each frequency divided by its factor (transformers' order of operations)
        factors = rope.long_factor if long else rope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** exponents)
    if rope.rope_type == "yarn":
        return _yarn_frequencies(rope, head_dim, rope.theta ** exponents)
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":  # positions interpolated: every frequency divided by the factor
        return inv_freq / rope.factor
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


def _yarn_frequencies(rope: RopeConfig, dim: int, pos_freqs: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies, transformers' operations in its order: the dimensions that turn fewer than ``beta_slow``
    times within the original context interpolated (divided by ``factor``), those that turn more than ``beta_fast``
    times kept, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each frequency extrapolated (kept as it is)
    return (1.0 / (rope.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


def rope_row(position: int, long_rope: bool, long_from: int | None) -> int:
    """The row of a ``RotaryEmbedding``'s tables that rotates a token at ``position``: the position itself, or, for a
    sequence past LongRoPE's original context (``long_rope``; ``long_from``: that context, where the tables have
    long rows), ``long_from + position``: every token of such a sequence rotates by the long factors, as transformers
    rotates a forward whose longest position is past the original context (its Phi-3 generate computes the whole
    sequence again when it grows past it: ``Scheduler``)."""
    return long_from + position if long_rope and long_from is not None else position


def sequence_rows(n: int, long_from: int | None, device: torch.device) -> torch.Tensor:
    """``rope_row`` of the ``n`` tokens of one whole sequence in one forward (a training sequence: every token by the
    long factors where ``n`` is past ``long_from``, as transformers rotates a forward over it)."""
    rows = torch.arange(n, device=device)
    return rows + long_from if long_from is not None and n > long_from else rows


class RotaryEmbedding:
    """A cos/sin table for every position up to ``max_positions``, applied by row (``rope_row``: a token's position,
    LongRoPE's long rows after the short ones) to the first ``rotary_dim`` dimensions of each head (all of them by
    default); the others pass through."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int,
                 device: torch.device, dtype: torch.dtype, rotary_dim: int | None = None,
                 long_from: int | None = None) -> None:
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        cos, sin = _cos_sin(inverse_frequencies(rope, rotary_dim), max_positions)
        # LongRoPE past its original context: the short rows of positions [0, long_from), then the long rows of
        # every position (a long prompt's tokens rotate by the long factors from position 0)
        self.long_from = long_from if long_from is not None and long_from < max_positions else None
        if self.long_from is not None:
            long_cos, long_sin = _cos_sin(inverse_frequencies(rope, rotary_dim, long=True), max_positions)
            cos, sin = torch.cat([cos[:self.long_from], long_cos]), torch.cat([sin[:self.long_from], long_sin])
        if rope.attention_factor != 1.0:  # LongRoPE's and YaRN's, on both tables before the cast (as HF)
            cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
        self.cos = cos.to(device=device, dtype=dtype)
        half = rotary_dim // 2
        # sin with its first half negated: ``rotate_half(x) * sin`` is then ``x.roll(half) * sin_signed``, one
        # kernel where rotate_half takes four (two slices, a negation, a cat), and bit for bit the same product
        # (a sign moved between factors is exact)
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(device=device, dtype=dtype)
        self.max_positions = max_positions
        self.rotary_dim = rotary_dim
        self.partial = rotary_dim < head_dim
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin_signed)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` by their tokens' ``positions`` ``[T]``."""
        return self.rotate(q, positions), self.rotate(k, positions)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate one of ``q`` or ``k`` (``[T, H, D]``) as ``__call__`` does."""
        cos, sin_signed = self.tables(positions)
        if self.partial:  # HF: cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass])
            rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
            return torch.cat([rot * cos + rot.roll(self.rotary_dim // 2, -1) * sin_signed, rest], dim=-1)
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed  # HF: x * cos + rotate_half(x) * sin

    def rotate_backward(self, dy: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        """The transpose of ``rotate`` for gradients ``dy`` ``[n, H, D]``, into ``out``: ``dy cos + (dy
        sin_signed).roll(R/2)`` over the rotated dimensions (rolling by half of them is its own inverse), ``dy`` as it
        is over the others."""
        cos, sin_signed = self.tables(positions)
        r = self.rotary_dim
        rot, out_rot = (dy[..., :r], out[..., :r]) if self.partial else (dy, out)
        torch.mul(rot, cos, out=out_rot)
        out_rot += (rot * sin_signed).roll(r // 2, -1)
        if self.partial:
            out[..., r:] = dy[..., r:]

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_signed)`` ``[T, 1, R]`` of ``positions`` (rows: ``rope_row``; ``sin_signed``: sin with its first
        half negated; R the rotated dimensions); the last call's are reused while the same ``positions`` tensor comes
        back (every layer of one forward passes the same one)."""
        last = self._last
        if last is not None and last[0] is positions:
            return last[1], last[2]
        cos, sin_signed = self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)
        self._last = (positions, cos, sin_signed)
        return cos, sin_signed


def _cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin ``[P, R]`` of positions ``0 .. P - 1`` rotated by ``inv_freq`` ``[R / 2]``."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, R]
    return emb.cos(), emb.sin()
