"""Measuring activation memory: what PyTorch autograd saves, and the process's peak RSS."""

from __future__ import annotations

import resource
import sys

import torch

from coserve.finetune.reference import whole_sequence_loss
from coserve.model.decoder import Bypass, DecoderModel


def autograd_saved_bytes(model: DecoderModel, bypass: Bypass, token_ids: list[int], targets: list[int]) -> int:
    """Bytes of activations autograd saves for one whole-sequence backward (weights excluded).

    Counted with saved-tensor hooks (``saved_activation_bytes``), each storage once.
    """
    weights = {model.embed.data_ptr(), model.lm_head.data_ptr(), model.norm.data_ptr()}
    for layer in model.layers:
        for t in (layer.input_norm, layer.post_norm, layer.qkv, layer.qkv_bias, layer.qk_norm, layer.o, layer.o_bias,
                  layer.gate_up, layer.down, layer.router, layer.router_bias, layer.router_logit_bias,
                  *layer.expert_gate_up, *layer.expert_down, *(layer.expert_gate_up_bias or ()),
                  *(layer.expert_down_bias or ()), layer.shared_gate_up, layer.shared_down, layer.shared_gate):
            if t is not None:
                weights.add(t.data_ptr())
    weights.update(p.data_ptr() for p in getattr(bypass, "parameters", lambda: [])())
    return saved_activation_bytes(lambda: whole_sequence_loss(model, bypass, token_ids, targets), weights)


def saved_activation_bytes(forward, weight_ptrs: set[int]) -> int:
    """Bytes autograd saves while ``forward()`` runs, storages in ``weight_ptrs`` excluded, each storage once."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weight_ptrs:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    del loss
    return sum(seen.values())


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
