"""The pruned executor (``--rematerialize cheap``): the decoder's ``layer_forward`` with a tap that
keeps the plan's tensors, and a hand-written backward that reads them instead of recomputing the
frozen matmuls.

Kept per token and layer, besides the layer input and K/V: the rotated queries, the residual
after attention, the gate and up outputs, and what the bypasses' backward reads (LoRA's
``x A^T``; IA3's frozen outputs). Cheap tensors (the two norms, SiLU, the MLP product) are
recomputed; attention is recomputed from the kept q, K and V under autograd.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from coserve.finetune.window_attention import window_attention
from coserve.model.decoder import DecoderLayer, DecoderModel, rms_norm


@dataclass(slots=True)
class LayerKeep:
    """One layer's kept tensors for one sequence, ``[N, ...]``, filled by forward windows."""

    q: torch.Tensor  # [N, Hq, D] rotated queries
    resid: torch.Tensor  # [N, H] residual stream after attention
    gate: torch.Tensor  # [N, I] gate output (after its bypass)
    up: torch.Tensor  # [N, I] up output (after its bypass)
    bypass: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> [N, r] or [N, out]

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.resid, self.gate, self.up, *self.bypass.values()]


def new_layer_keep(model: DecoderModel, n: int) -> LayerKeep:
    c = model.cfg
    z = lambda *shape: torch.zeros(*shape, device=model.device, dtype=model.dtype)  # noqa: E731
    return LayerKeep(z(n, c.num_heads, c.head_dim), z(n, c.hidden_size), z(n, c.intermediate_size),
                     z(n, c.intermediate_size))


def forward_layer(model: DecoderModel, layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor, attend,
                  bypass, keep: LayerKeep, a: int, b: int) -> torch.Tensor:
    """``layer_forward`` on rows ``a:b``, its tap storing the plan's tensors into ``keep``."""
    out, _, _ = model.layer_forward(layer, x, positions, attend, bypass, keep_tap(keep, a, b))
    return out


def keep_tap(keep: LayerKeep, a: int, b: int, first_row: int = 0):
    """A ``layer_forward`` tap storing rows ``first_row:`` of what it sees into ``keep``'s rows ``a:b``."""

    def tap(name: str, value: torch.Tensor) -> None:
        value = value[first_row:]
        if name in ("q", "resid", "gate", "up"):
            getattr(keep, name)[a:b] = value
            return
        if name not in keep.bypass:  # a bypass's own kept tensor, allocated on first sight
            keep.bypass[name] = torch.zeros(keep.q.shape[0], value.shape[1], device=value.device,
                                            dtype=value.dtype)
        keep.bypass[name][a:b] = value

    return tap


def backward_layer(model: DecoderModel, layer: DecoderLayer, bypass, keep: LayerKeep, x: torch.Tensor,
                   dout: torch.Tensor, positions: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                   dk_acc: torch.Tensor, dv_acc: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Gradient w.r.t. the layer input for rows ``a:b``; adds prefix dK/dV into ``dk_acc``/``dv_acc[:a]``.

    ``dout`` ``[n, H]`` is dL/d(layer output); ``dk_acc``/``dv_acc`` ``[N, Hkv, D]`` hold what later
    windows contributed to this window's own K/V. Bypass parameter gradients accumulate.
    """
    cfg, i = model.cfg, layer.index
    n = x.shape[0]
    # MLP: out = resid + down(silu(gate) * up)
    gate, up, resid = keep.gate[a:b], keep.up[a:b], keep.resid[a:b]
    silu = F.silu(gate)
    dact = _module_backward(bypass, keep, i, "down_proj", silu * up, layer.down, dout, a, b)
    dgate = torch.ops.aten.silu_backward(dact * up, gate)
    dup = dact * silu
    h2 = rms_norm(resid, layer.post_norm, cfg.rms_norm_eps) if _touches(bypass, "gate_proj", "up_proj") else None
    dgate, ex_g = _out_backward(bypass, keep, i, "gate_proj", h2, dgate, a, b)
    dup, ex_u = _out_backward(bypass, keep, i, "up_proj", h2, dup, a, b)
    dh2 = torch.cat([dgate, dup], dim=-1) @ layer.gate_up
    dh2 = _plus(dh2, ex_g, ex_u)
    dresid = dout + _rms_norm_backward(dh2, resid, layer.post_norm, cfg.rms_norm_eps)
    # attention, recomputed from the kept q, K and V under autograd
    q = keep.q[a:b].detach().requires_grad_()
    k_prefix, v_prefix = k_all[:a].detach().requires_grad_(), v_all[:a].detach().requires_grad_()
    k_own, v_own = k_all[a:b].detach().requires_grad_(), v_all[a:b].detach().requires_grad_()
    with torch.enable_grad():
        attn = window_attention(q, k_prefix, v_prefix, k_own, v_own, model.scale)
    dattn = _module_backward(bypass, keep, i, "o_proj", attn.detach(), layer.o, dresid, a, b)
    attn.backward(dattn)
    if a:
        dk_acc[:a] += k_prefix.grad
        dv_acc[:a] += v_prefix.grad
    dq = _rope_backward(model, q.grad, positions).reshape(n, cfg.q_size)
    dk = _rope_backward(model, k_own.grad + dk_acc[a:b], positions).reshape(n, cfg.kv_size)
    dv = (v_own.grad + dv_acc[a:b]).reshape(n, cfg.kv_size)
    h1 = rms_norm(x, layer.input_norm, cfg.rms_norm_eps) if _touches(bypass, "q_proj", "k_proj", "v_proj") else None
    dq, ex_q = _out_backward(bypass, keep, i, "q_proj", h1, dq, a, b)
    dk, ex_k = _out_backward(bypass, keep, i, "k_proj", h1, dk, a, b)
    dv, ex_v = _out_backward(bypass, keep, i, "v_proj", h1, dv, a, b)
    dh1 = _plus(torch.cat([dq, dk, dv], dim=-1) @ layer.qkv, ex_q, ex_k, ex_v)
    return dresid + _rms_norm_backward(dh1, x, layer.input_norm, cfg.rms_norm_eps)


def _touches(bypass, *modules: str) -> bool:
    """Whether the bypass acts on any of ``modules`` (else their inputs need not be recomputed)."""
    return bypass is not None and any(m in bypass.modules for m in modules)


def _out_backward(bypass, keep, i, module, x, dy, a, b):
    if bypass is None or module not in bypass.modules:
        return dy, None
    kept = keep.bypass[module][a:b] if module in keep.bypass else None
    return bypass.output_backward(i, module, x, kept, dy)


def _module_backward(bypass, keep, i, module, x, weight, dy, a, b):
    """dL/dx of ``bypass.output(bypass.input(x) @ W^T)`` given dL/dy (no frozen-weight gradient)."""
    if bypass is None or module not in bypass.modules:
        return dy @ weight
    x_in = bypass.input(i, module, x)
    dy, extra = _out_backward(bypass, keep, i, module, x_in, dy, a, b)
    return bypass.input_backward(i, module, x, _plus(dy @ weight, extra))


def _plus(t: torch.Tensor, *extras: torch.Tensor | None) -> torch.Tensor:
    for e in extras:
        if e is not None:
            t = t + e
    return t


def _rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """dL/dx of ``weight * (x * rsqrt(mean(x^2) + eps))`` (computed in float32 like the forward)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    g = dy.float() * weight.float()
    return (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)


def _rope_backward(model: DecoderModel, dy: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The transpose of the rotation ``y = x cos + rotate_half(x) sin`` for ``[n, H, D]`` gradients."""
    cos = model.rope.cos[positions].unsqueeze(1)
    sin = model.rope.sin[positions].unsqueeze(1)
    ys = dy * sin
    half = dy.shape[-1] // 2
    return dy * cos + torch.cat((ys[..., half:], -ys[..., :half]), dim=-1)
