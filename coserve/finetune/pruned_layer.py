"""The pruned executor (``--rematerialize cheap``): the decoder's ``layer_forward`` with a tap that
keeps the plan's tensors, and a hand-written backward that reads them instead of recomputing the
frozen matmuls.

Kept per token and layer, besides the layer input and K/V: whichever of the rotated queries,
attention's output and log-sum-exp, the residual after attention and the gate and up outputs
the graph-pruning plan stores, and what the bypasses' backward reads (LoRA's ``x A^T``; IA3's
frozen outputs). Cheap tensors (the two norms, SiLU, the MLP product) are recomputed. With
attention's output kept, its backward runs from it (``window_attention_backward``); without,
attention is recomputed from q, K and V under autograd. What else the plan does not store is
recomputed from what it does: q from the input, the residual from attention's output, gate or
up from the residual.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from coserve.finetune.graph import LayerShape
from coserve.finetune.graph_pruning import DEFAULT_MEMORY_TARGET, PruningPlan, plan_model
from coserve.finetune.moe_backward import moe_input_grad
from coserve.finetune.window_attention import (kept_attention_supported, window_attention, window_attention_backward,
                                               window_attention_lse)
from coserve.model.attention_spec import AttentionSpec
from coserve.model.decoder import DecoderLayer, DecoderModel, bypass_output, bypassed_linear, rms_norm
from coserve.model.linear_modules import EXPERT_MODULES, ROUTER, SHARED_EXPERT_MODULES
from coserve.model.norm_grad import rms_norm_backward, rms_norm_stats
from coserve.peft.trainable import add_grads

# The base layer's tensors a plan may store or recompute (attention's two outputs go together); the norms' per-row
# statistics (rsqrt(mean(x^2) + eps), float32) by their graph names.
BASE_KEEPS = ("rms_attn", "q", "attn.o", "attn.lse", "resid", "rms_mlp", "gate", "up",
              "q_pre", "q_rms", "k_pre", "k_rms",  # these four: Qwen3's q/k norms' inputs and per-head statistics
              "moe.probs", "moe.gu")  # a mixture of experts': its router's probabilities, its experts' gate/up outputs
_FLOAT32_KEEPS = ("rms_attn", "attn.lse", "rms_mlp", "q_rms", "k_rms", "moe.probs")
_MOE_KEEPS = ("moe.probs", "moe.gu")
_QK_NORM_KEEPS = ("q_pre", "q_rms", "k_pre", "k_rms")


# What the host's time to dispatch one operation is worth in FLOPs, by device type (the pruning plan charges it for
# each operation a backward window's recomputation runs, ``RECOMPUTE_DISPATCHES``, spread over the window's tokens).
# CPU: measured on a 2-core Xeon, where recomputing q, attention and the residual (34 dispatches) instead of the gate
# projection (2) cost 0.29 ms more a window on a 24-layer `tiny` at 32 tokens, some 9 us a dispatch, at the 300
# GFLOP/s its packed GEMMs reach. CUDA: an estimate, not a measurement (some 10 us a launch from Python at 50 TFLOP/s);
# a GPU session should time it.
DISPATCH_FLOPS = {"cpu": 2e6, "cuda": 5e8}


def executor_plan(model: DecoderModel, peft_config: Any, rematerialize: str,
                  memory_target: float = DEFAULT_MEMORY_TARGET, max_tokens: int = 1024,
                  dispatch_flops: float | None = None) -> PruningPlan:
    """The graph-pruning plan the executors run for ``model`` with ``peft_config``'s bypasses, for
    sequences of up to ``max_tokens`` tokens: attention's recompute FLOPs grow with them, and the host's time for
    each operation a window's recomputation dispatches (``dispatch_flops``; None: the device's ``DISPATCH_FLOPS``;
    0 prices FLOPs alone) is spread over them."""
    if dispatch_flops is None:
        dispatch_flops = DISPATCH_FLOPS.get(model.device.type, 0.0)
    tokens = max(1, max_tokens)
    shape = LayerShape.from_model_config(model.cfg, model.embed.element_size(), context_tokens=max(1, tokens // 2))
    # Where attention's kept-output backward exists, the plan may keep the output; else the
    # executor recomputes attention from q, K and V in its backward.
    how = "flash" if kept_attention_supported(model.device) and model.cfg.attn_softcap is None else "recompute"
    return plan_model(shape, peft_config, model.cfg.num_layers, rematerialize, attention_backward=how,
                      memory_target=memory_target, op_flops=dispatch_flops / tokens)


def planned_keeps(plan: PruningPlan) -> frozenset[str]:
    """The base-layer tensors (``BASE_KEEPS``) that ``plan`` stores."""
    return frozenset(k.name for k in plan.kept if k.name in BASE_KEEPS)


@dataclass(slots=True)
class LayerKeep:
    """One layer's kept tensors for one sequence, ``[N, ...]``, filled by forward windows."""

    num_tokens: int
    base: dict[str, torch.Tensor]  # stored BASE_KEEPS by name: rms_attn/rms_mlp [N, 1] float32, q [N, Hq, D],
    #   attn.o [N, Hq*D], attn.lse [N, Hq] float32, resid [N, H], gate/up [N, I], q_pre [N, Hq, D],
    #   q_rms [N, Hq, 1] float32, k_pre [N, Hkv, D], k_rms [N, Hkv, 1] float32
    bypass: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> [N, r] or [N, out]

    def get(self, name: str, a: int, b: int) -> torch.Tensor | None:
        """Rows ``a:b`` of a stored base tensor, or None when the plan recomputes it."""
        t = self.base.get(name)
        return t if t is None or (a == 0 and b == self.num_tokens) else t[a:b]  # whole: no slice to dispatch

    def tensors(self) -> list[torch.Tensor]:
        return [*self.base.values(), *self.bypass.values()]


def new_layer_keep(model: DecoderModel, n: int, names: frozenset[str] | tuple[str, ...] = BASE_KEEPS,
                   layer: int = 0) -> LayerKeep:
    """Room for layer ``layer``'s ``names`` (a subset of BASE_KEEPS; those of q/k norms only where the model has them;
    a dense MLP's gate/up or a mixture's routing, whichever the layer has) over ``n`` tokens."""
    c = model.cfg
    moe = c.moe_layer(layer)
    inter = c.dense_intermediate_size if c.moe and not moe else c.intermediate_size  # a dense layer's in a mixture
    shapes = {"rms_attn": (n, 1), "q": (n, c.num_heads, c.head_dim), "attn.o": (n, c.q_size),
              "attn.lse": (n, c.num_heads), "resid": (n, c.hidden_size), "rms_mlp": (n, 1),
              "gate": (n, inter), "up": (n, inter),
              "q_pre": (n, c.num_heads, c.head_dim), "q_rms": (n, c.num_heads, 1),
              "k_pre": (n, c.num_kv_heads, c.head_dim), "k_rms": (n, c.num_kv_heads, 1),
              "moe.probs": (n, c.num_experts), "moe.gu": (n, c.experts_per_token, 2 * c.intermediate_size)}
    unknown = set(names) - set(shapes)
    if unknown:
        raise ValueError(f"new_layer_keep: unknown tensors {sorted(unknown)}; choose from {', '.join(BASE_KEEPS)}")
    if ("attn.o" in names) != ("attn.lse" in names):
        raise ValueError("new_layer_keep: attention's output and log-sum-exp are kept together or not at all")
    if not c.qk_norm:  # no q/k norms: nothing of theirs to keep
        names = set(names) - set(_QK_NORM_KEEPS)
    gu = bool({"gate", "up", "moe.gu"} & set(names))
    if moe:  # the router's probabilities always (a few bytes), the experts' gate/up where the plan keeps gate/up
        names = set(names) - {"gate", "up"} | {"moe.probs"} | ({"moe.gu"} if gu else set())
    else:  # a dense MLP's gate and up where the plan keeps them (or a mixture's plan its experts')
        names = set(names) - set(_MOE_KEEPS) | ({"gate", "up"} if c.moe and gu else set())
    if c.attn_softcap is not None:  # capped scores: no kept-output backward (autograd recomputes attention)
        names = set(names) - {"attn.o", "attn.lse"}
    if "attn.o" in names and not kept_attention_supported(model.device):
        raise ValueError(f"new_layer_keep: no kept-output attention backward on {model.device.type}")
    return LayerKeep(n, {k: torch.empty(shapes[k], device=model.device,
                                        dtype=torch.float32 if k in _FLOAT32_KEEPS else model.dtype)
                         for k in BASE_KEEPS if k in names})


def new_keeps(model: DecoderModel, n: int, names: frozenset[str] | tuple[str, ...] = BASE_KEEPS) -> list[LayerKeep]:
    """Every layer's ``LayerKeep`` for a sequence of ``n`` tokens."""
    return [new_layer_keep(model, n, names, i) for i in range(model.cfg.num_layers)]


def forward_layer(model: DecoderModel, layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor, attend,
                  bypass, keep: LayerKeep, a: int, b: int) -> torch.Tensor:
    """``layer_forward`` on rows ``a:b``, its tap storing the plan's tensors into ``keep``."""
    out, _, _ = model.layer_forward(layer, x, positions, attend, bypass, keep_tap(keep, a, b))
    return out


def window_attend(keep: LayerKeep | None, a: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  spec: AttentionSpec) -> torch.Tensor:
    """A forward window's attention (rows ``a:b`` of its sequence); stores its output and log-sum-exp
    into ``keep`` when the plan keeps them."""
    if keep is None or "attn.o" not in keep.base:
        return window_attention(q, k, v, spec)
    out, lse = window_attention_lse(q, k, v, spec)
    keep.base["attn.o"][a:b] = out
    keep.base["attn.lse"][a:b] = lse
    return out


def keep_tap(keep: LayerKeep, a: int, b: int, first_row: int = 0):
    """A ``layer_forward`` tap storing into ``keep``'s rows ``a:b`` the base tensors' rows ``first_row:first_row
    + b - a`` (a fused forward's inference rows come first, padding after) and a bypass's kept tensor as it comes:
    the bypass trains the window's rows only (``Bypass.output_keep``)."""
    last_row = first_row + b - a

    def tap(name: str, value: torch.Tensor) -> None:
        if name in BASE_KEEPS:
            store = keep.base.get(name)
            if store is None:
                return
            if first_row or last_row != value.shape[0]:  # else every row is the window's: no slice to dispatch
                value = value[first_row:last_row]
        else:
            if name in EXPERT_MODULES and (first_row or last_row != value.shape[0]):  # an expert LoRA's: every row's
                value = value[first_row:last_row]
            store = keep.bypass.get(name)
            if store is None:  # a bypass's own kept tensor, allocated on first sight
                store = keep.bypass[name] = torch.empty(keep.num_tokens, value.shape[1], device=value.device,
                                                        dtype=value.dtype)
        store[a:b] = value

    return tap


# The backward's stages, last module first; a layer whose input needs no gradient (layer 0:
# its input is the frozen embedding) stops after the stage of its lowest bypassed module.
_STAGES = (("down_proj", *EXPERT_MODULES, ROUTER, *SHARED_EXPERT_MODULES), ("gate_proj", "up_proj", "gate_up_proj"),
           ("o_proj",),
           ("q_proj", "k_proj", "v_proj", "qkv_proj"))


@torch.no_grad()  # by hand: autograd records nothing (attention recomputed without its kept output turns it back on)
def backward_layer(model: DecoderModel, layer: DecoderLayer, bypass, keep: LayerKeep, x: torch.Tensor,
                   dout: torch.Tensor, positions: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                   dk_acc: torch.Tensor, dv_acc: torch.Tensor, a: int, b: int, need_input_grad: bool = True
                   ) -> torch.Tensor | None:
    """Gradient w.r.t. the layer input for rows ``a:b``; adds prefix dK/dV into ``dk_acc``/``dv_acc[:a]``.

    ``dout`` ``[n, H]`` is dL/d(layer output); ``dk_acc``/``dv_acc`` ``[N, Hkv, D]`` hold what later
    windows contributed to this window's own K/V. Bypass parameter gradients accumulate.
    What ``keep`` does not store is recomputed: q from the input (with q/k norms, from their inputs, themselves
    kept or recomputed from the input), attention from q, K and V,
    the residual from attention's output, gate and up from the residual. With
    ``need_input_grad`` False it returns None, having run only the stages down to the lowest
    bypassed module (as autograd does when the layer input does not require grad). Gemma's norms of the attention's
    and the MLP's outputs (their inputs recomputed from attention's output and the MLP's input), its tanh-GELU and
    Granite's residual multiplier are run through as the forward has them.
    """
    cfg, i = model.cfg, layer.index
    n = x.shape[0]
    last = len(_STAGES) if need_input_grad else _lowest_stage(bypass)
    if last == 0:
        return None
    eps = cfg.rms_norm_eps
    q = keep.get("q", a, b)
    # Qwen3's q/k norms: their inputs, kept or recomputed from the input norm, to recompute q or for their backward
    q_pre = keep.get("q_pre", a, b) if cfg.qk_norm and (q is None or last > 3) else None
    k_pre = keep.get("k_pre", a, b) if cfg.qk_norm and last > 3 else None
    need_q_pre = cfg.qk_norm and (q is None or last > 3) and q_pre is None
    need_k_pre = cfg.qk_norm and last > 3 and k_pre is None
    rstd1, stats1 = keep.get("rms_attn", a, b), None  # the input norm's statistic, kept or recomputed
    h1 = None  # the input norm, where recomputed (its backward reads the statistics too)
    whole = layer.q_norm_whole is not None  # OLMo 2's norms of all of q's heads and of k's: their inputs recomputed
    if (q is None and not cfg.qk_norm) or need_q_pre or need_k_pre or _touches(bypass, *_STAGES[3]) or whole:
        if layer.input_norm is None:  # OLMo 2: the attention reads the layer input as it is
            h1 = x
        else:
            stats1 = _norm_stats(x, rstd1, eps)
            h1 = rms_norm(x, layer.input_norm, eps, stats1)
    if need_q_pre:
        q_pre = _projection(model, layer, bypass, "q_proj", h1).view(n, cfg.num_heads, cfg.head_dim)
    if need_k_pre:
        k_pre = _projection(model, layer, bypass, "k_proj", h1).view(n, cfg.num_kv_heads, cfg.head_dim)
    # OLMo 2: q's projection before its norm, recomputed once for q and for the norm's backward
    q_proj = _projection(model, layer, bypass, "q_proj", h1) if whole and (q is None or last > 3) else None
    q_stats = _norm_stats(q_pre, keep.get("q_rms", a, b), eps) if q_pre is not None else None
    if q is None:  # recomputed values, not graphs: no gradient flows through a recomputation
        if cfg.qk_norm:
            q = _rotated(model, i, rms_norm(q_pre, layer.qk_norm[:cfg.num_heads], eps, q_stats), positions)
        else:
            q = rms_norm(q_proj, layer.q_norm_whole, eps) if whole else _projection(model, layer, bypass, "q_proj", h1)
            q = _rotated(model, i, q.reshape(n, cfg.num_heads, cfg.head_dim), positions)
    o, lse = keep.get("attn.o", a, b), keep.get("attn.lse", a, b)
    if o is None:  # attention, recomputed from q, K and V (under autograd when its backward runs)
        q = q.detach().requires_grad_()
        k_win, v_win = k_all[:b].detach().requires_grad_(), v_all[:b].detach().requires_grad_()
        with torch.set_grad_enabled(last > 3):
            attn = window_attention(q, k_win, v_win, model.attention[i])
        o = attn.detach()
    resid = keep.get("resid", a, b)
    # Gemma: the attention's projection, normalised before the residual add (its norm's backward reads it)
    o_proj = (bypassed_linear(bypass, None, i, "o_proj", o, layer.o, model.linear, layer.o_bias)
              if resid is None or layer.attn_out_norm is not None else None)
    rm = cfg.residual_multiplier  # Granite: each block's output scaled before its residual add
    if resid is None:
        attn_out = o_proj if layer.attn_out_norm is None else rms_norm(o_proj, layer.attn_out_norm, eps)
        resid = x + (attn_out if rm is None else attn_out * rm)
    rstd2, stats2 = keep.get("rms_mlp", a, b), None
    if layer.router is not None:  # a mixture of experts: by hand from its kept routing (and its experts' LoRA's)
        stats2 = _norm_stats(resid, rstd2, eps)
        gu = keep.get("moe.gu", a, b)
        need_h2 = gu is None or layer.shared_gate_up is not None or _touches(bypass, EXPERT_MODULES[0], ROUTER)
        h2 = rms_norm(resid, layer.post_norm, eps, stats2) if need_h2 else None
        kept = {m: keep.bypass[m][a:b].unflatten(1, (cfg.experts_per_token, -1)) for m in EXPERT_MODULES
                if m in keep.bypass}
        kept.update({m: keep.bypass[m][a:b] for m in ("moe.router", *SHARED_EXPERT_MODULES) if m in keep.bypass})
        dh2 = moe_input_grad(model, layer, h2, dout, keep.get("moe.probs", a, b), gu, bypass, kept)
        if last < 3:  # only the experts were adapted below here
            return None
        dresid = dout + rms_norm_backward(dh2, resid, layer.post_norm_f32, eps, stats2)
    else:
        gate, up = keep.get("gate", a, b), keep.get("up", a, b)
        h2 = None
        if layer.post_norm is None:  # OLMo 2: the MLP reads the residual as it is
            h2 = resid
        elif gate is None or up is None or _touches(bypass, *_STAGES[1]):
            stats2 = _norm_stats(resid, rstd2, eps)
            h2 = rms_norm(resid, layer.post_norm, eps, stats2)
        inter = layer.gate_weight.shape[0]  # the MLP's width (a mixture's dense layers': dense_intermediate_size)
        if (gate is None or up is None) and _touches(bypass, "gate_up_proj"):  # Phi-3's bypass: over both at once
            gate, up = bypass_output(bypass, None, i, "gate_up_proj", h2,
                                     model.linear(h2, layer.gate_up)).chunk(2, dim=-1)
        if gate is None:
            gate = bypass_output(bypass, None, i, "gate_proj", h2, model.linear(h2, layer.gate_weight))
        if up is None:
            up = bypass_output(bypass, None, i, "up_proj", h2, model.linear(h2, layer.up_weight))
        # MLP: out = resid + down(act(gate) * up) (Gemma: the down projection normalised first)
        act = model.act(gate)
        # the down_proj bypass reads the MLP's input; Gemma's output norm, the projection recomputed from it
        mlp_in = act * up if _touches(bypass, "down_proj") or layer.mlp_out_norm is not None else None
        dmlp = dout if rm is None else dout * rm
        if layer.mlp_out_norm is not None:
            mlp_out = bypassed_linear(bypass, None, i, "down_proj", mlp_in, layer.down, model.linear)
            dmlp = rms_norm_backward(dmlp, mlp_out, layer.mlp_out_norm, eps)
        dact = _module_backward(model, bypass, keep, i, "down_proj", mlp_in, layer.down, dmlp, a, b, need_dx=last > 1)
        if last == 1:
            return None
        dgu = torch.empty(n, 2 * inter, device=x.device, dtype=x.dtype)  # [dgate | dup]
        dgate, dup = dgu.chunk(2, dim=-1)
        if cfg.activation == "gelu_tanh":  # Gemma's
            torch.ops.aten.gelu_backward.grad_input(dact * up, gate, approximate="tanh", grad_input=dgate)
        else:
            torch.ops.aten.silu_backward.grad_input(dact * up, gate, grad_input=dgate)
        torch.mul(dact, act, out=dup)
        ex_g = _out_backward_into(bypass, keep, i, "gate_proj", h2, dgate, a, b)
        ex_u = _out_backward_into(bypass, keep, i, "up_proj", h2, dup, a, b)
        ex_gu = _out_backward_into(bypass, keep, i, "gate_up_proj", h2, dgu, a, b)
        if last == 2:
            return None
        dh2 = add_grads(model.input_grad(dgu, layer.gate_up), ex_g, ex_u, ex_gu)
        dresid = dout + (dh2 if layer.post_norm is None else rms_norm_backward(
            dh2, resid, layer.post_norm_f32, eps, stats2 or _norm_stats(resid, rstd2, eps)))
    do_proj = dresid if rm is None else dresid * rm
    if layer.attn_out_norm is not None:
        do_proj = rms_norm_backward(do_proj, o_proj, layer.attn_out_norm, eps)
    dattn = _module_backward(model, bypass, keep, i, "o_proj", o, layer.o, do_proj, a, b, need_dx=last > 3)
    if last == 3:
        return None
    if lse is None:
        attn.backward(dattn)
        q_grad, k_grad, v_grad = q.grad, k_win.grad, v_win.grad
    else:
        q_grad, k_grad, v_grad = window_attention_backward(dattn, q, k_all[:b], v_all[:b], o, lse,
                                                           model.attention[i])
    if a:
        dk_acc[:a] += k_grad[:a]
        dv_acc[:a] += v_grad[:a]
    k_own_grad, v_own_grad = k_grad[a:], v_grad[a:]
    if b < dk_acc.shape[0]:  # later windows of this layer contributed to these positions' K/V
        k_own_grad += dk_acc[a:b]
        v_own_grad += dv_acc[a:b]
    dqkv = torch.empty(n, cfg.q_size + 2 * cfg.kv_size, device=x.device, dtype=x.dtype)  # [dq | dk | dv]
    dq, dk, dv = dqkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    dqk = dqkv[:, :cfg.q_size + cfg.kv_size].unflatten(1, (-1, cfg.head_dim))
    if model.ropes[i] is None:  # SmolLM3's layers without position encoding
        dqk.copy_(torch.cat([q_grad, k_own_grad], dim=1))
    else:
        model.ropes[i].rotate_backward(torch.cat([q_grad, k_own_grad], dim=1), positions, dqk)  # q and k in one pass
    if cfg.qk_norm:  # through the norms of q's and k's heads, in one pass too
        k_stats = _norm_stats(k_pre, keep.get("k_rms", a, b), eps)
        stats = torch.cat([q_stats[0], k_stats[0]], dim=1), torch.cat([q_stats[1], k_stats[1]], dim=1)
        dqk.copy_(rms_norm_backward(dqk, stats[0], layer.qk_norm_f32, eps, stats))
    if whole:  # through OLMo 2's norms of all of q's heads and of k's, from their inputs recomputed
        dq.copy_(rms_norm_backward(dq, q_proj, layer.q_norm_whole, eps))
        dk.copy_(rms_norm_backward(dk, _projection(model, layer, bypass, "k_proj", h1), layer.k_norm_whole, eps))
    dv.copy_(v_own_grad.flatten(1))
    ex_q = _out_backward_into(bypass, keep, i, "q_proj", h1, dq, a, b)
    ex_k = _out_backward_into(bypass, keep, i, "k_proj", h1, dk, a, b)
    ex_v = _out_backward_into(bypass, keep, i, "v_proj", h1, dv, a, b)
    ex_qkv = _out_backward_into(bypass, keep, i, "qkv_proj", h1, dqkv, a, b)
    if not need_input_grad:
        return None
    dh1 = add_grads(model.input_grad(dqkv, layer.qkv), ex_q, ex_k, ex_v, ex_qkv)
    if layer.input_norm is None:
        return dresid + dh1
    return dresid + rms_norm_backward(dh1, x, layer.input_norm_f32, eps, stats1 or _norm_stats(x, rstd1, eps))


def _projection(model: DecoderModel, layer: DecoderLayer, bypass, module: str, h: torch.Tensor) -> torch.Tensor:
    """``q_proj``'s or ``k_proj``'s output ``[n, out]`` (bias and bypass included) recomputed from the input norm
    (under Phi-3's bypass of all of q, k and v, their rows of it)."""
    weight = layer.q_weight if module == "q_proj" else layer.k_weight
    lo = 0 if module == "q_proj" else model.cfg.q_size
    if _touches(bypass, "qkv_proj"):
        qkv = bypass_output(bypass, None, layer.index, "qkv_proj", h, model.linear(h, layer.qkv, layer.qkv_bias))
        return qkv[:, lo:lo + weight.shape[0]]
    bias = layer.qkv_bias[lo:lo + weight.shape[0]] if layer.qkv_bias is not None else None
    return bypass_output(bypass, None, layer.index, module, h, model.linear(h, weight, bias))


def _rotated(model: DecoderModel, i: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x`` rotated by layer ``i``'s RoPE (as it is in a layer without one)."""
    rope = model.ropes[i]
    return x if rope is None else rope.rotate(x, positions)


def _norm_stats(x: torch.Tensor, rstd: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm's statistics over rows ``x``: the forward's kept ``rstd`` where the plan stores it, else recomputed."""
    return rms_norm_stats(x, eps) if rstd is None else (x.float(), rstd)


def _lowest_stage(bypass) -> int:
    """How many of ``_STAGES`` the backward must run to reach every bypassed module."""
    return max((s + 1 for s, modules in enumerate(_STAGES) if _touches(bypass, *modules)), default=0)


def _touches(bypass, *modules: str) -> bool:
    """Whether the bypass acts on any of ``modules`` (else their inputs need not be recomputed)."""
    return bypass is not None and any(m in bypass.modules for m in modules)


def _out_backward(bypass, keep, i, module, x, dy, a, b):
    if bypass is None or module not in bypass.modules:
        return dy, None
    kept = keep.bypass[module][a:b] if module in keep.bypass else None
    return bypass.output_backward(i, module, x, kept, dy)


def _out_backward_into(bypass, keep, i, module, x, dy, a, b):
    """``_out_backward`` writing the gradient for the frozen output back into ``dy`` (a buffer view)."""
    dy_new, extra = _out_backward(bypass, keep, i, module, x, dy, a, b)
    if dy_new is not dy:
        dy.copy_(dy_new)
    return extra


def _module_backward(model, bypass, keep, i, module, x, weight, dy, a, b, need_dx=True):
    """dL/dx of ``bypass.output(bypass.input(x) @ W^T)`` given dL/dy (no frozen-weight gradient);
    with ``need_dx`` False only the bypass's parameter gradients (None returned)."""
    if bypass is None or module not in bypass.modules:
        return model.input_grad(dy, weight) if need_dx else None
    x_in = bypass.input(i, module, x)
    dy, extra = _out_backward(bypass, keep, i, module, x_in, dy, a, b)
    if not need_dx and not bypass.scales_input(module):
        return None
    dx = bypass.input_backward(i, module, x, add_grads(model.input_grad(dy, weight), extra))
    return dx if need_dx else None
