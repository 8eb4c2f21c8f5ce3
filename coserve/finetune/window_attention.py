"""Causal attention of a window of tokens over its sequence's keys so far, and its backward.

``window_attention`` is autograd-friendly (the recompute path). ``window_attention_lse`` also
returns the softmax's log-sum-exp, so that ``window_attention_backward`` can produce the
gradients from the kept output alone, without recomputing the forward, through the kernel
pairs PyTorch's own SDPA backward uses (``kept_attention_supported``): the flash kernels on
the CPU (they take a mask and grouped K/V heads), the memory-efficient ones on CUDA (K/V
heads repeated per query head, the mask as an additive bias).

gpt-oss's sinks ride on the same kernels: with a sink ``s`` a row's output is the kernel's ``o`` times ``r =
sigmoid(lse - s)`` (the sink's share of the softmax taken out). Its backward, for ``y = r o`` and ``g = dL/dy``:
``o`` gets ``r g``, and ``lse`` gets ``<g, o> r (1 - r)``, which adds ``p`` times that to the scores' gradient; the
kernels compute the scores' gradient as ``p (dP - D)`` with ``D = <dO, O>`` taken from the output they are given, so
handing them ``dO = r g`` and ``O = y`` gives ``D = r^2 <g, o>``, which is the standard ``<r g, o>`` less that
``lse`` term: the kept ``y`` and ``lse`` suffice, as without sinks.
"""

from __future__ import annotations

import functools

import torch

from coserve.model.attention import sdpa, sink_logits
from coserve.model.attention_spec import AttentionSpec
from coserve.model.forward_batch import causal_mask


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Attention of the window's queries over the sequence's first ``p + n`` keys, causal within the window (and
    under the layer's sliding window, over each query's last ``window`` positions alone; with a soft cap or sinks,
    Gemma 2's capped scores or gpt-oss's sinks: ``explicit_attention``, whose backward autograd takes; a capped
    layer has no kept-output backward, a layer with sinks has, ``window_attention_lse``'s).

    Args:
        q: ``[n, Hq, D]`` rotated queries of the window's tokens (positions ``p .. p + n - 1``).
        k, v: ``[p + n, Hkv, D]`` the sequence's K/V up to the window's end: the prefix the
            window attends to in full, then the window's own (callers pass slices of the
            sequence's K/V cache, so no copy is made).

    Returns:
        ``[n, Hq * D]``.
    """
    n, p, w = _sizes(q, k, spec.window)
    masked = bool(p) or w is not None
    mask = _allowed(n, p, q.device, w) if masked else None
    out = sdpa(*_heads_first(q, k, v), attn_mask=mask, is_causal=not masked, scale=spec.scale,
               enable_gqa=True, softcap=spec.softcap, sinks=spec.sinks)  # [1, Hq, n, D]
    return _merged_heads(out)


def kept_attention_supported(device: torch.device) -> bool:
    """Whether ``window_attention_lse`` / ``window_attention_backward`` run on ``device``."""
    return torch.device(device).type in ("cpu", "cuda")


def window_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``window_attention`` and the log-sum-exp of each query's scaled scores (without the sinks'):
    ``([n, Hq*D], [n, Hq] float32)``; uncapped scores only (a capped layer's plan keeps no attention output)."""
    _uncapped(spec, "window_attention_lse")
    n, p, w, scale = *_sizes(q, k, spec.window), spec.scale
    masked = bool(p) or w is not None
    if q.is_cuda:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            *_heads_first(q, *_repeat_kv(q, k, v)), _bias(n, p, q, w), True, 0.0, not masked, scale=scale)
        lse = lse[..., :n]  # padded to a multiple of 32 rows
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_heads_first(q, k, v), 0.0, not masked,
            attn_mask=_additive_mask(n, p, q.device, q.dtype, w) if masked else None, scale=scale)
    lse = _rows_first(lse).float()
    if spec.sinks is not None:  # each row's output scaled by what the sink leaves of its softmax
        out = (_rows_first(out) * _sink_share(lse, spec).unsqueeze(-1).to(out.dtype)).flatten(1)
        return out, lse
    return _merged_heads(out), lse


def window_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, spec: AttentionSpec
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [n, Hq, D], dk [p + n, Hkv, D], dv [p + n, Hkv, D])`` of ``window_attention`` given
    dL/d(output) ``dout`` ``[n, Hq*D]``, the kept ``out`` and ``lse`` of ``window_attention_lse`` (with sinks: the
    module docstring)."""
    _uncapped(spec, "window_attention_backward")
    if spec.sinks is not None:
        share = _sink_share(lse, spec).to(dout.dtype)
        dout = (dout.unflatten(1, (share.shape[1], -1)) * share.unsqueeze(-1)).flatten(1)
    n, p, w, scale = *_sizes(q, k, spec.window), spec.scale
    masked = bool(p) or w is not None
    heads, d = q.shape[1], q.shape[2]
    as_heads = lambda t: _split_heads(t, heads, d)  # noqa: E731
    lse_h = _heads_first(lse)[0]  # [1, Hq, n]
    if q.is_cuda:
        qh, kh, vh = _heads_first(q, *_repeat_kv(q, k, v))
        padded = torch.zeros(1, heads, -(-n // 32) * 32, device=q.device, dtype=torch.float32)
        padded[..., :n] = lse_h
        empty = torch.zeros((), dtype=torch.long, device=q.device)
        bias = _bias(n, p, q, w)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            as_heads(dout).contiguous(), qh, kh, vh, bias, as_heads(out), padded, empty, empty, 0.0,
            [True, True, True, False], not masked, scale=scale)
        group = heads // k.shape[1]
        if group > 1:  # the repeated heads' gradients summed back onto their K/V head
            dk = dk.unflatten(1, (k.shape[1], group)).sum(2)
            dv = dv.unflatten(1, (k.shape[1], group)).sum(2)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            as_heads(dout), *_heads_first(q, k, v), as_heads(out), lse_h, 0.0, not masked,
            attn_mask=_additive_mask(n, p, q.device, q.dtype, w) if masked else None, scale=scale)
    return _rows_first(dq), _rows_first(dk), _rows_first(dv)


def _uncapped(spec: AttentionSpec, name: str) -> None:
    if spec.softcap is not None:
        raise ValueError(f"{name}: the kernels keep no capped attention (softcap {spec.softcap}); recompute it")


def _sink_share(lse: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """``sigmoid(lse - sink)`` ``[n, Hq]`` float32: what of each row's softmax its head's sink leaves to the keys."""
    return torch.sigmoid(lse - sink_logits(spec.sinks, lse.device))


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[L, Hkv, D]`` with each head repeated for its group of query heads: ``[L, Hq, D]``."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _bias(n: int, p: int, q: torch.Tensor, window: int | None = None) -> torch.Tensor | None:
    """The memory-efficient kernels' additive mask ``[1, Hq, n, p + n]`` (a broadcast view over rows
    whose stride is a multiple of 16, as they require), or None when the window is the whole prefix (and no
    sliding window narrows it)."""
    if not p and window is None:
        return None
    return _padded_mask(n, p, q.device, q.dtype, window)[:, :p + n].expand(1, q.shape[1], n, p + n)


def _sizes(q: torch.Tensor, k: torch.Tensor, window: int | None = None) -> tuple[int, int, int | None]:
    """``(n, p, window)``: the window's queries, the prefix before them, and the layer's sliding window where it
    masks anything (None where every query's window reaches back to the first position)."""
    n = q.shape[0]
    p = k.shape[0] - n
    if p < 0:
        raise ValueError(f"window_attention: {k.shape[0]} keys for {n} queries")
    return n, p, window if window is not None and p + n > window else None


# Layouts change by views. Where autograd records nothing (the finetuning windows' passes) each is one
# ``as_strided`` with the very sizes and strides the transposes and unsqueezes would give (one dispatched operation
# where they take two or three: a quarter of a backward window's operations were these); under autograd, the
# transposes, whose backward is plain.
def _plain(*ts: torch.Tensor) -> bool:
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def _heads_first(*ts: torch.Tensor) -> list[torch.Tensor]:
    """``[L, H, D]`` -> ``[1, H, L, D]`` views (``[L, H]`` -> ``[1, H, L]``)."""
    if not _plain(*ts):
        return [t.transpose(0, 1).unsqueeze(0) for t in ts]
    return [t.as_strided((1, t.shape[1], t.shape[0], *t.shape[2:]),
                         (t.shape[1] * t.stride(1), t.stride(1), t.stride(0), *t.stride()[2:])) for t in ts]


def _rows_first(t: torch.Tensor) -> torch.Tensor:
    """``[1, H, L, D]`` -> ``[L, H, D]`` (``[1, H, L]`` -> ``[L, H]``), a view."""
    if not _plain(t):
        return t[0].transpose(0, 1)
    return t.as_strided((t.shape[2], t.shape[1], *t.shape[3:]), (t.stride(2), t.stride(1), *t.stride()[3:]))


def _merged_heads(t: torch.Tensor) -> torch.Tensor:
    """``[1, H, L, D]`` -> ``[L, H * D]``: a view where the heads lie side by side in each row (the kernels' output
    layout), else a copy."""
    heads, rows, d = t.shape[1], t.shape[2], t.shape[3]
    if _plain(t) and t.stride(1) == d * t.stride(3):
        return t.as_strided((rows, heads * d), (t.stride(2), t.stride(3)))
    return t[0].transpose(0, 1).reshape(rows, -1)


def _split_heads(t: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """``[L, H * D]`` -> ``[1, H, L, D]``, a view."""
    if not _plain(t):
        return t.reshape(t.shape[0], heads, d).transpose(0, 1).unsqueeze(0)
    return t.as_strided((1, heads, t.shape[0], d), (heads * d * t.stride(1), d * t.stride(1), t.stride(0), t.stride(1)))


# A forward window's layers (and a backward window's forward and backward) share one mask: the
# last few are kept (each at most a window's rows by the sequence's length).
@functools.lru_cache(maxsize=4)
def _allowed(n: int, p: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """``[n, p + n]`` bool: whether query ``i`` (position ``p + i``) may attend to key ``j`` (``causal_mask``)."""
    return causal_mask(n, p, device, window)


@functools.lru_cache(maxsize=4)
def _additive_mask(n: int, p: int, device: torch.device, dtype: torch.dtype, window: int | None = None
                   ) -> torch.Tensor:
    """``_allowed`` as the flash kernels take it: 0 where allowed, -inf elsewhere."""
    allowed = _allowed(n, p, device, window)
    return torch.zeros(n, p + n, device=device, dtype=dtype).masked_fill_(~allowed, float("-inf"))


@functools.lru_cache(maxsize=4)
def _padded_mask(n: int, p: int, device: torch.device, dtype: torch.dtype, window: int | None = None
                 ) -> torch.Tensor:
    """``_additive_mask`` in a buffer whose rows are padded to a multiple of 16 columns."""
    cols = -(-(p + n) // 16) * 16
    out = torch.full((n, cols), float("-inf"), device=device, dtype=dtype)
    out[:, :p + n] = _additive_mask(n, p, device, dtype, window)
    return out
