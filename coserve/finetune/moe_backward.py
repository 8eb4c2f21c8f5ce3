"""The pruned backward of a mixture of experts (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GLM-4.5): dL/d(input) of
``moe.moe_mlp`` by hand, from what its forward window kept (the router's probabilities, and each token's experts'
gate/up outputs where the plan keeps them, else recomputed), without running the experts' down projections again; and
the gradients of a LoRA of the experts (PEFT's ``target_parameters``), whose down projection's LoRA is part of ``y_e``
below.

For a token routed to expert ``e`` with weight ``w``: its output adds ``w * y_e``, ``y_e = down_e(act(g) * u)``. So ``dm
= w * (dy @ down_e)`` reaches ``m = act(g) * u``, then g and u, then the input through ``gate_up_e``; and the weight's
own gradient is ``<dy, y_e> = <dy @ down_e, m>``, which needs no ``y_e``. The weights are the router's softmax
probabilities of the token's top experts (renormalised to sum to one where the config says; GLM-4.5's sigmoid scores,
renormalised and scaled): their gradient goes back through the renormalisation and the softmax (the sigmoid) to the
router's logits, then through the router to the input, as autograd takes it in a whole-sequence backward. The choice of
experts (GLM-4.5's correction bias and groups among it) has no gradient.
"""

from __future__ import annotations

import torch

from coserve.model.decoder import DecoderLayer, DecoderModel
from coserve.model.linear_modules import EXPERT_MODULES, ROUTER, SHARED_EXPERT_MODULES
from coserve.model.moe import clamped_glu, clamped_glu_backward, expert_groups, route_scores
from coserve.peft.trainable import add_grads


@torch.no_grad()
def moe_input_grad(model: DecoderModel, layer: DecoderLayer, h: torch.Tensor | None, dout: torch.Tensor,
                   probs: torch.Tensor, gu: torch.Tensor | None, bypass=None,
                   kept: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """dL/d(input) ``[n, H]`` of ``layer``'s mixture given dL/d(output) ``dout`` ``[n, H]``, the router's probabilities
    ``probs`` ``[n, E]`` (float32; GLM-4.5's sigmoid scores: ``moe.router_scores``) and the experts' gate/up outputs
    ``gu`` ``[n, k, 2I]`` (None: recomputed from the input ``h``, which Qwen2-MoE's shared expert always needs). A
    trainable ``bypass`` adapting the experts (``EXPERT_MODULES``; it needs ``h`` for gate/up's) or the router
    (``ROUTER``; ``h`` too) gets its gradients, from what its forward kept (``kept``: by module, the experts' ``x
    A_e^T`` ``[n, k, r]`` or recomputed, the router's as ``moe.router``, Qwen2-MoE's shared expert's modules' as
    theirs)."""
    cfg = model.cfg
    experts, weights = route_scores(cfg, probs, dout.dtype, layer.router_bias)
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
            bias = None if layer.expert_gate_up_bias is None else layer.expert_gate_up_bias[e]  # gpt-oss's
            g_u = model.linear(x, layer.expert_gate_up[e], bias)[:rows.numel()]
            if gate_up_lora:
                g_u = bypass.expert_output(layer.index, EXPERT_MODULES[0], e, rows, h[rows], g_u)
        gate, up = g_u.chunk(2, dim=-1)
        glu = cfg.glu_alpha > 0  # gpt-oss's clamped SwiGLU, else SiLU's
        act = None if glu else model.act(gate)
        m = clamped_glu(gate, up, cfg.glu_alpha, cfg.glu_limit) if glu else act * up
        dmw = model.input_grad(dout[rows], layer.expert_down[e])  # dL/dm, the weight not yet applied
        if down_lora:  # its LoRA's gradients for the weighted dout, its share of dL/dm for dout itself
            dmw += bypass.expert_backward(layer.index, EXPERT_MODULES[1], e, m, lora_xa[EXPERT_MODULES[1]],
                                          dout[rows], weights[rows, slot, None])
        dw[rows, slot] = (dmw.float() * m.float()).sum(-1)
        if layer.expert_down_bias is not None:  # y_e = down_e(m) + b: the weight's gradient has <dy, b> too
            dw[rows, slot] += (dout[rows].float() * layer.expert_down_bias[e].float()).sum(-1)
        dm = (dmw * weights[rows, slot, None]).to(dout.dtype)
        dgu = torch.empty_like(g_u)
        dgate, dup = dgu.chunk(2, dim=-1)
        if glu:
            clamped_glu_backward(dm, gate, up, cfg.glu_alpha, cfg.glu_limit, dgate, dup)
        else:
            torch.ops.aten.silu_backward.grad_input(dm * up, gate, grad_input=dgate)
            torch.mul(dm, act, out=dup)
        dx = model.input_grad(dgu, layer.expert_gate_up[e])
        if gate_up_lora:
            dx += bypass.expert_backward(layer.index, EXPERT_MODULES[0], e, h[rows], lora_xa[EXPERT_MODULES[0]], dgu)
        dh.index_add_(0, rows, dx)
    chosen = probs.gather(1, experts)
    sigmoid = cfg.router == "sigmoid"
    if sigmoid:  # GLM-4.5's weights: its scores (renormalised) times routed_scaling
        dw = dw * cfg.routed_scaling
    if cfg.norm_topk_prob:  # w = p / sum(p): dp_j = (dw_j - sum_i dw_i w_i) / sum(p) (GLM-4.5: sum(p) + 1e-20)
        total = chosen.sum(-1, keepdim=True) + (1e-20 if sigmoid else 0.0)
        dchosen = (dw - (dw * (chosen / total)).sum(-1, keepdim=True)) / total
    else:
        dchosen = dw
    dprobs = torch.zeros_like(probs).scatter_(1, experts, dchosen)
    if sigmoid:  # each score's own sigmoid
        dlogits = dprobs * probs * (1 - probs)
    else:  # the softmax's backward
        dlogits = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
    dlogits = dlogits.to(layer.router.dtype)  # GLM-4.5's router runs in float32 whatever the model's dtype
    extra = None
    if bypass is not None and ROUTER in bypass.modules:  # the router's adapter (LoRA, DoRA, IA3), from its kept tensor
        dlogits, extra = bypass.output_backward(layer.index, ROUTER, h, kept.get("moe.router"), dlogits)
    add_grads(dh, model.input_grad(dlogits, layer.router).to(dh.dtype), extra)
    if layer.shared_gate_up is not None:  # Qwen2-MoE's shared expert, recomputed from the input
        dh.add_(_shared_expert_input_grad(model, layer, h, dout, bypass, kept))
    return dh


def _shared_expert_input_grad(model: DecoderModel, layer: DecoderLayer, h: torch.Tensor, dout: torch.Tensor,
                              bypass=None, kept: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """dL/d(input) of Qwen2-MoE's ``sigmoid(z(h)) * shared(h)``: through the shared expert scaled by its gate, and
    through the gate (``s (1 - s)`` times the output's projection on ``dout``); a ``bypass`` of its modules
    (``SHARED_EXPERT_MODULES``) gets its gradients from what its forward kept (``kept``, by module), as a dense
    MLP's. GLM-4.5's shared experts are ungated: through them alone."""
    kept = kept or {}
    i = layer.index
    gate_module, up_module, down_module, gate_z = SHARED_EXPERT_MODULES

    def through(module: str, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, object]:
        """The bypass's backward of ``module`` (its gradients accumulate): the gradient for the frozen output and
        any extra one for the input."""
        if bypass is None or module not in bypass.modules:
            return dy, None
        return bypass.output_backward(i, module, x, kept.get(module), dy)

    _, gu, out, scale = model.shared_expert(layer, h, bypass=bypass)
    gate, up = gu.chunk(2, dim=-1)
    act = model.act(gate)
    mlp_in = act * up
    dy, extra_m = through(down_module, mlp_in, dout if scale is None else dout * scale)
    dm = add_grads(model.input_grad(dy, layer.shared_down), extra_m)
    dgu = torch.empty_like(gu)
    dgate, dup = dgu.chunk(2, dim=-1)
    torch.ops.aten.silu_backward.grad_input(dm * up, gate, grad_input=dgate)
    torch.mul(dm, act, out=dup)
    dgate_frozen, extra_g = through(gate_module, h, dgate)
    dup_frozen, extra_u = through(up_module, h, dup)
    dgate.copy_(dgate_frozen)
    dup.copy_(dup_frozen)
    if scale is None:
        return add_grads(model.input_grad(dgu, layer.shared_gate_up), extra_g, extra_u)
    dz, extra_z = through(gate_z, h, (dout * out).sum(-1, keepdim=True) * scale * (1 - scale))
    return add_grads(model.input_grad(dgu, layer.shared_gate_up), model.input_grad(dz, layer.shared_gate), extra_g,
                     extra_u, extra_z)
