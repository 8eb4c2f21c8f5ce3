"""For finetuning tests: a trainable bypass moved away from its initialisation, and one sequence's window schedule
checked against a whole-sequence autograd backward."""

from __future__ import annotations

import random

import torch

from coserve.finetune.pruned_layer import BASE_KEEPS, executor_plan, new_keeps, planned_keeps
from coserve.finetune.reference import whole_sequence_loss
from coserve.finetune.sequence_state import IGNORE_INDEX, new_sequence_state
from coserve.finetune.token_windows import backward_window, forward_window
from coserve.peft.config import IA3Config
from coserve.peft.trainable import TrainableIA3, TrainableLora


def perturbed_bypass(cfg, model, seed: int):
    """A LoRA (DoRA) or IA3 bypass of ``cfg`` over ``model`` with every parameter moved away from its init, so that
    every path carries gradient."""
    gen = torch.Generator().manual_seed(seed)
    if isinstance(cfg, IA3Config):
        bypass = TrainableIA3(cfg, model.module_shapes(), model.cfg.num_layers, model.device)
    else:
        bypass = TrainableLora(cfg, model.module_shapes(), model.cfg.num_layers, model.device, gen,
                               base_weight=model.module_weight, experts=model.expert_shapes())
    with torch.no_grad():
        for p in bypass.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen).to(p.device))
    return bypass


def check_windows_match_autograd(model, bypass, n: int, remat: str, forward_sizes: tuple[int, ...],
                                 backward_sizes: list[int], seed: int = 1, dropout_seed: int = 1,
                                 tol: float = 1e-5) -> None:
    """A random ``n``-token sequence (some targets masked) through forward windows of ``forward_sizes`` and backward
    windows drawn from ``backward_sizes`` (``seed`` draws the tokens and the windows, ``dropout_seed`` the sequence's
    dropout masks), keeping what ``remat`` says (``all``: nothing; ``cheap``: the plan's
    tensors; ``cheap:none``; ``cheap:every``): the bypass's gradients equal one whole-sequence autograd backward's
    (relative error <= ``tol``)."""
    rng = random.Random(seed)
    ids = [rng.randrange(5, model.cfg.vocab_size) for _ in range(n)]
    targets = [t if rng.random() > 0.3 else IGNORE_INDEX for t in ids[1:]] + [IGNORE_INDEX]
    total = sum(t != IGNORE_INDEX for t in targets)
    bypass.zero_grad()
    (whole_sequence_loss(model, bypass, ids, targets, dropout_seed=dropout_seed) / total).backward()
    ref = [p.grad.clone() for p in bypass.parameters()]
    bypass.zero_grad()
    state = new_sequence_state(ids, targets, model.cfg.num_layers, model.cfg.hidden_size, model.cfg.num_kv_heads,
                               model.cfg.head_dim, model.device, model.dtype, model.long_rope_from)
    state.dropout_seed = dropout_seed
    if remat != "all":
        names = {"cheap": lambda: planned_keeps(executor_plan(model, bypass.config, "cheap", max_tokens=n)),
                 "cheap:none": lambda: (), "cheap:every": lambda: BASE_KEEPS}[remat]()
        state.keeps = new_keeps(model, n, names)
    for size in forward_sizes:
        forward_window(model, bypass, state, size, 1.0 / total)
    while not state.finished:
        backward_window(model, bypass, state, rng.choice(backward_sizes))
    for p, r in zip(bypass.parameters(), ref):
        assert r.abs().max() > 0
        assert (p.grad - r).norm() / r.norm() <= tol, float((p.grad - r).norm() / r.norm())
