"""Mixture-of-experts MLPs (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GLM-4.5): the checkpoint's names, and the forward
over a flat batch, with the LoRA of the experts where an adapter has one (PEFT's ``target_parameters``).

Each token's router logits (a linear map of the MLP's input) go through a float32 softmax (GLM-4.5: a sigmoid,
``router_scores``); the token runs through the ``experts_per_token`` experts scoring highest (GLM-4.5: by the scores
plus a correction bias, among the best groups of experts: ``route_scores``), each a SiLU-gated MLP, and their outputs
are summed weighted by those scores (renormalised to sum to one where the config says; GLM-4.5's then scaled), as HF's
``MixtralExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts`` and ``Glm4MoeExperts`` compute them: expert by expert in
index order, each adding into a zero-initialised output.

Batch invariance: an expert's matmul runs over the rows routed to it, whose count depends on the batch beside them;
each expert's rows are therefore padded with zero rows to ``padded_rows`` of their count (at least
``BATCH_INVARIANT_ROWS``; whole GEMM tiles where tiles are on), the sizes from which a row's result does not depend
on its neighbours (``batch_invariance.py``). A token's sum over its experts runs in the same order whatever rows are
beside it.
"""

from __future__ import annotations

from typing import Callable

import torch

from coserve.model.config import ModelConfig
from coserve.model.linear_modules import EXPERT_MODULES
from coserve.model.row_invariant import elementwise_sigmoid


def router_name(cfg: ModelConfig, layer: int) -> str:
    """The checkpoint's router weight ``[E, H]`` of ``layer`` (gpt-oss's bias beside it: ``.bias``)."""
    if cfg.architecture == "GptOssForCausalLM":
        return f"model.layers.{layer}.mlp.router.weight"
    block = "block_sparse_moe" if cfg.architecture == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def fused_expert_names(layer: int) -> tuple[str, str, str, str]:
    """gpt-oss's experts, as its checkpoint holds them: ``(gate_up [E, H, 2I] (gate and up interleaved), its bias
    [E, 2I], down [E, I, H], its bias [E, H])``."""
    p = f"model.layers.{layer}.mlp.experts."
    return p + "gate_up_proj", p + "gate_up_proj_bias", p + "down_proj", p + "down_proj_bias"


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated unit: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``,
    as ``GptOssExperts._apply_gate``. The sigmoid element by element (``elementwise_sigmoid``): over a contiguous
    ``[P, I]`` an elementwise kernel computes the last few elements by its scalar path, and which rows those are
    depends on the expert call's row count, which a co-served window changes."""
    g = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (g * elementwise_sigmoid(g * alpha))


def clamped_glu_backward(dm: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float,
                         dgate: torch.Tensor, dup: torch.Tensor) -> None:
    """The gradients of ``clamped_glu`` at ``gate`` and ``up`` (into ``dgate`` and ``dup``) given ``dm`` at its
    output; none through a clamped value (torch's clamp passes it at the bounds themselves)."""
    g = gate.clamp(max=limit)
    u = up.clamp(-limit, limit)
    s = torch.sigmoid(g * alpha)
    torch.mul(dm * (u + 1) * (s + g * alpha * s * (1 - s)), gate <= limit, out=dgate)
    torch.mul(dm * (g * s), (up >= -limit) & (up <= limit), out=dup)


def expert_names(cfg: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """The checkpoint's ``(gate [I, H], up [I, H], down [H, I])`` weights of one expert (Mixtral's w1, w3, w2)."""
    if cfg.architecture == "MixtralForCausalLM":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def router_bias_name(layer: int) -> str:
    """GLM-4.5's correction bias ``[E]`` of ``layer``'s router (added to its scores to choose the experts)."""
    return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"


def shared_expert_names(cfg: ModelConfig, layer: int) -> tuple[str, str, str, str | None]:
    """The shared expert's ``(gate [S, H], up [S, H], down [H, S])`` and its gate ``[1, H]``: Qwen2-MoE's
    ``shared_expert`` and ``shared_expert_gate``; GLM-4.5's ``shared_experts``, ungated (None)."""
    if not cfg.shared_expert_gated:
        p = f"model.layers.{layer}.mlp.shared_experts"
        return p + ".gate_proj.weight", p + ".up_proj.weight", p + ".down_proj.weight", None
    p = f"model.layers.{layer}.mlp.shared_expert"
    return p + ".gate_proj.weight", p + ".up_proj.weight", p + ".down_proj.weight", p + "_gate.weight"


def router_scores(cfg: ModelConfig, logits: torch.Tensor) -> torch.Tensor:
    """The router's float32 scores ``[T, E]`` from its logits: their softmax, or GLM-4.5's sigmoid of each."""
    if cfg.router == "sigmoid":
        return elementwise_sigmoid(logits.float())
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def route(cfg: ModelConfig, logits: torch.Tensor, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's experts ``[T, k]`` and their weights ``[T, k]`` (float32 for Mixtral and GLM-4.5, else the logits'
    dtype) from router logits ``[T, E]`` (``bias``: GLM-4.5's correction bias of the layer)."""
    return route_scores(cfg, router_scores(cfg, logits), logits.dtype, bias)


def route_scores(cfg: ModelConfig, scores: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` from the router's float32 scores ``[T, E]`` (``router_scores``). A softmax router's experts are its
    ``experts_per_token`` highest probabilities, highest first; GLM-4.5's the highest of ``scores + bias`` within the
    ``topk_groups`` groups (of ``expert_groups`` equal ones, in index order) whose two best such scores sum highest,
    weighted by their scores (renormalised over them plus 1e-20 where ``norm_topk_prob``), times ``routed_scaling``,
    as ``Glm4MoeTopkRouter``."""
    k = cfg.experts_per_token
    if cfg.router != "sigmoid":
        weights, experts = torch.topk(scores, k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights if cfg.moe_weights_float32 else weights.to(dtype)
    choice = scores if bias is None else scores + bias
    if cfg.topk_groups < cfg.expert_groups:  # the experts of the best groups only
        grouped = choice.unflatten(1, (cfg.expert_groups, -1))
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_groups, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    experts = torch.topk(choice, k, dim=-1).indices
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, (weights * cfg.routed_scaling).to(torch.float32 if cfg.moe_weights_float32 else dtype)


def expert_groups(experts: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(expert, rows, slots)`` for each expert some row of ``experts`` ``[T, k]`` picks, in expert order; each
    expert's rows ascending (``torch.where(experts == e)``'s), found with one stable sort and one transfer of the
    counts to the host (not one search and one transfer an expert)."""
    k = experts.shape[1]
    flat = experts.flatten()
    order = torch.sort(flat, stable=True).indices  # by expert, then by row (row-major [T, k] order)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    groups, start = [], 0
    for e, count in enumerate(counts):
        if count:
            picked = order[start:start + count]
            groups.append((e, picked // k, picked % k))
            start += count
    return groups


def moe_mlp(cfg: ModelConfig, h: torch.Tensor, logits: torch.Tensor, gate_up: list[torch.Tensor],
            down: list[torch.Tensor], linear: Callable[..., torch.Tensor], act: Callable[[torch.Tensor], torch.Tensor],
            padded_rows: Callable[[int], int], tap: Callable[[str, torch.Tensor], None] | None = None,
            bypass=None, layer: int = 0, bias: torch.Tensor | None = None,
            expert_biases: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> torch.Tensor:
    """The mixture's output ``[T, H]`` for MLP inputs ``h`` ``[T, H]`` and their router logits ``[T, E]``: each expert's
    fused ``gate_up`` ``[2I, H]`` and ``down`` ``[H, I]``; ``linear`` runs a frozen matmul, ``padded_rows(n)`` the rows
    an expert's call over ``n`` routed rows runs in; ``bias``: GLM-4.5's correction bias of the router;
    ``expert_biases``: gpt-oss's biases of each expert's gate/up and down (its gated unit ``clamped_glu``).
    Differentiable (a finetuning window's recompute runs it under autograd). A finetuning window's ``tap`` gets the
    router's scores (``moe.probs`` ``[T, E]`` float32: ``router_scores``) and each row's experts' gate/up outputs
    (``moe.gu`` ``[T, k, 2I]``, in the order of its experts), which its pruned backward reads
    (``coserve/finetune/moe_backward.py``). A ``bypass`` (a ``Bypass`` of layer ``layer``) adapting the experts
    (``EXPERT_MODULES`` in its ``modules``) adds its LoRA to each expert's call (``expert_output``); a tap then also
    gets what its backward reads, under the module's name (``[T, k * r]``: each row's, by its experts in order)."""
    probs = router_scores(cfg, logits)
    experts, weights = route_scores(cfg, probs, logits.dtype, bias)
    k = cfg.experts_per_token
    kept = h.new_empty(h.shape[0], k, gate_up[0].shape[0]) if tap is not None else None
    adapted = [m for m in EXPERT_MODULES if bypass is not None and m in bypass.modules]
    lora_kept: dict[str, torch.Tensor] = {}

    def adapt(module: str, e: int, rows: torch.Tensor, slot: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
        if module not in adapted:
            return y
        if tap is None:
            return bypass.expert_output(layer, module, e, rows, x, y)
        y, xa = bypass.expert_output_keep(layer, module, e, rows, x, y)
        if xa is not None:
            if module not in lora_kept:
                lora_kept[module] = xa.new_zeros(h.shape[0], k, xa.shape[1])
            lora_kept[module][rows, slot] = xa
        return y

    out = torch.zeros_like(h)
    gu_bias, down_bias = expert_biases or (None, None)
    for e, rows, slot in expert_groups(experts, cfg.num_experts):
        n = rows.numel()
        x = h[rows]
        pad = padded_rows(n) - n
        if pad > 0:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        gu = adapt(EXPERT_MODULES[0], e, rows, slot, x, linear(x, gate_up[e], None if gu_bias is None else gu_bias[e]))
        if kept is not None:
            kept[rows, slot] = gu[:n]
        gate, up = gu.chunk(2, dim=-1)
        m = clamped_glu(gate, up, cfg.glu_alpha, cfg.glu_limit) if cfg.glu_alpha else act(gate) * up
        y = linear(m, down[e], None if down_bias is None else down_bias[e])
        y = adapt(EXPERT_MODULES[1], e, rows, slot, m, y)[:n] * weights[rows, slot, None]
        out = out.index_add(0, rows, y.to(out.dtype))
    if tap is not None:
        tap("moe.probs", probs)
        tap("moe.gu", kept)
        for module, xa in lora_kept.items():
            tap(module, xa.flatten(1))
    return out
