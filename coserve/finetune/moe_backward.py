"""The pruned backward of a mixture of experts (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE): dL/d(input) of ``moe.moe_mlp``
by hand, from what its forward window kept (the router's probabilities, and each token's experts' gate/up outputs
where the plan keeps them, else recomputed), without running the experts' down projections again; and the gradients
of a LoRA of the experts (PEFT's ``target_parameters``), whose down projection's LoRA is part of ``y_e`` below.

For a token routed to expert ``e`` with weight ``w``: its output adds ``w * y_e``, ``y_e = down_e(act(g) * u)``. So
``dm = w * (dy @ down_e)`` reaches ``m = act(g) * u``, then g and u, then the input through ``gate_up_e``; and the
weight's own gradient is ``<dy, y_e> = <dy @ down_e, m>``, which needs no ``y_e``. The weights are the router's
softmax probabilities of the token's top experts (renormalised to sum to one where the config says): their gradient
goes back through the renormalisation and the softmax to the router's logits, then through the router to the input,
as autograd takes it in a whole-sequence backward.
"""

from __future__ import annotations

import torch

from coserve.model.decoder import DecoderLayer, DecoderModel
from coserve.model.linear_modules import EXPERT_MODULES, ROUTER
from coserve.peft.trainable import LowRank
from coserve.model.moe import expert_groups, route_probs


@torch.no_grad()
def moe_input_grad(model: DecoderModel, layer: DecoderLayer, h: torch.Tensor | None, dout: torch.Tensor,
                   probs: torch.Tensor, gu: torch.Tensor | None, bypass=None,
                   kept: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """dL/d(input) ``[n, H]`` of ``layer``'s mixture given dL/d(output) ``dout`` ``[n, H]``, the router's
    probabilities ``probs`` ``[n, E]`` (float32) and the experts' gate/up outputs ``gu`` ``[n, k, 2I]`` (None:
    recomputed from the input ``h``, which Qwen2-MoE's shared expert always needs). A trainable ``bypass`` adapting
    the experts (``EXPERT_MODULES``; it needs ``h`` for gate/up's) or the router (``ROUTER``; ``h`` too) gets its
    gradients, from what its forward kept (``kept``: by module, the experts' ``x A_e^T`` ``[n, k, r]`` or recomputed,
    the router's as ``moe.router``)."""
    cfg = model.cfg
    experts, weights = route_probs(cfg, probs, dout.dtype)
    n, k = experts.shape
    adapted = [m for m in EXPERT_MODULES if bypass is not None and m in bypass.modules]
    kept = kept or {}
    gate_up_lora, down_lora = EXPERT_MODULES[0] in adapted, EXPERT_MODULES[1] in adapted
    dh = torch.zeros_like(dout)
    dw = torch.zeros(n, k, dtype=torch.float32, device=dout.device)  # dL/d(each routing weight)
    for e, rows, slot in expert_groups(experts, cfg.num_experts):
        lora_xa = {m: kept[m][rows, slot] if m in kept else None for m in adapted}
        if gu is not None:
            g_u = gu[rows, slot]
        else:  # the expert's gate/up, recomputed as the forward ran them (a call of batch-invariant size)
            x = h[rows]
            pad = model.padded_rows(rows.numel()) - rows.numel()
            if pad > 0:
                x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            g_u = model.linear(x, layer.expert_gate_up[e])[:rows.numel()]
            if gate_up_lora:
                g_u = bypass.expert_output(layer.index, EXPERT_MODULES[0], e, rows, h[rows], g_u)
        gate, up = g_u.chunk(2, dim=-1)
        act = model.act(gate)
        dmw = model.input_grad(dout[rows], layer.expert_down[e])  # dL/dm, the weight not yet applied
        if down_lora:  # its LoRA's gradients for the weighted dout, its share of dL/dm for dout itself
            dmw += bypass.expert_backward(layer.index, EXPERT_MODULES[1], e, act * up, lora_xa[EXPERT_MODULES[1]],
                                          dout[rows], weights[rows, slot, None])
        dw[rows, slot] = (dmw.float() * (act * up).float()).sum(-1)
        dm = (dmw * weights[rows, slot, None]).to(dout.dtype)
        dgu = torch.empty_like(g_u)
        dgate, dup = dgu.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(dm * up, gate, grad_input=dgate)
        torch.mul(dm, act, out=dup)
        dx = model.input_grad(dgu, layer.expert_gate_up[e])
        if gate_up_lora:
            dx += bypass.expert_backward(layer.index, EXPERT_MODULES[0], e, h[rows], lora_xa[EXPERT_MODULES[0]], dgu)
        dh.index_add_(0, rows, dx)
    chosen = probs.gather(1, experts)
    if cfg.norm_topk_prob:  # w = p / sum(p): dp_j = (dw_j - sum_i dw_i w_i) / sum(p)
        total = chosen.sum(-1, keepdim=True)
        dchosen = (dw - (dw * (chosen / total)).sum(-1, keepdim=True)) / total
    else:
        dchosen = dw
    dprobs = torch.zeros_like(probs).scatter_(1, experts, dchosen)
    dlogits = (probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))).to(dout.dtype)  # the softmax's backward
    extra = None
    if bypass is not None and ROUTER in bypass.modules:  # the router's adapter (LoRA, DoRA, IA3), from its kept tensor
        dlogits, extra = bypass.output_backward(layer.index, ROUTER, h, kept.get("moe.router"), dlogits)
    dh.add_(model.input_grad(dlogits, layer.router))
    if isinstance(extra, LowRank):
        extra.add_to(dh)
    elif extra is not None:
        dh.add_(extra)
    if layer.shared_gate_up is not None:  # Qwen2-MoE's shared expert, recomputed from the input
        dh.add_(_shared_expert_input_grad(model, layer, h, dout))
    return dh


def _shared_expert_input_grad(model: DecoderModel, layer: DecoderLayer, h: torch.Tensor, dout: torch.Tensor
                              ) -> torch.Tensor:
    """dL/d(input) of Qwen2-MoE's ``sigmoid(h @ g) * shared(h)``: through the shared expert scaled by its gate, and
    through the gate (``s (1 - s)`` times the output's projection on ``dout``)."""
    _, gu, out, scale = model.shared_expert(layer, h)
    gate, up = gu.chunk(2, dim=-1)
    act = model.act(gate)
    dm = model.input_grad(dout * scale, layer.shared_down)
    dgu = torch.empty_like(gu)
    dgate, dup = dgu.chunk(2, dim=-1)
    torch.ops.aten.silu_backward.grad_input(dm * up, gate, grad_input=dgate)
    torch.mul(dm, act, out=dup)
    dz = (dout * out).sum(-1, keepdim=True) * scale * (1 - scale)
    return model.input_grad(dgu, layer.shared_gate_up).add_(model.input_grad(dz, layer.shared_gate))
