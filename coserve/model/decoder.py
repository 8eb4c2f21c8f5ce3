"""The Llama-family decoder (Llama, Qwen2, Mistral) over flat, unpadded token batches."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from coserve.model.attention import PagedKVCache, paged_attention
from coserve.model.config import ModelConfig
from coserve.model.forward_batch import ForwardBatch
from coserve.model.rope import RotaryEmbedding

# Linear modules a bypass network may attach to, with the fused weight each lives in.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterDelta(Protocol):
    """What the decoder asks of the adapters in a batch (implemented in ``coserve.peft``)."""

    def delta(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor | None:
        """The bypass output ``[T, out]`` to add to ``module``'s output for input ``x`` ``[T, in]``."""
        ...


class DecoderLayer:
    """One transformer block's frozen weights, with q/k/v and gate/up fused for fewer matmuls."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], index: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        p = f"model.layers.{index}."

        def w(name: str) -> torch.Tensor:
            return state[p + name].to(device=device, dtype=dtype)

        self.index = index
        self.input_norm = w("input_layernorm.weight")
        self.post_norm = w("post_attention_layernorm.weight")
        self.qkv = torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                              w("self_attn.v_proj.weight")])  # [q + 2kv, H]
        self.qkv_bias = (torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"),
                                    w("self_attn.v_proj.bias")]) if cfg.qkv_bias else None)
        self.o = w("self_attn.o_proj.weight")
        self.gate_up = torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])  # [2I, H]
        self.down = w("mlp.down_proj.weight")


class DecoderModel:
    """Embeddings, decoder layers, final norm and LM head of a causal LM.

    ``forward`` runs any mix of sequences' new tokens in one call: each row of the
    flat batch attends to its own sequence's cached prefix through the paged cache.
    """

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_positions: int) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.embed = state["model.embed_tokens.weight"].to(device=device, dtype=dtype)
        self.lm_head = (self.embed if cfg.tie_word_embeddings
                        else state["lm_head.weight"].to(device=device, dtype=dtype))
        self.norm = state["model.norm.weight"].to(device=device, dtype=dtype)
        self.layers = [DecoderLayer(cfg, state, i, device, dtype) for i in range(cfg.num_layers)]
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, device, dtype)
        self.scale = cfg.head_dim ** -0.5
        q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        # Where each adapter target sits inside the fused outputs: (fused name, start, end).
        self.fused_slices = {
            "q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, q + kv), "v_proj": ("qkv", q + kv, q + 2 * kv),
            "gate_proj": ("gate_up", 0, i), "up_proj": ("gate_up", i, 2 * i),
        }

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of every adapter-targetable linear module."""
        c = self.cfg
        return {"q_proj": (c.hidden_size, c.q_size), "k_proj": (c.hidden_size, c.kv_size),
                "v_proj": (c.hidden_size, c.kv_size), "o_proj": (c.q_size, c.hidden_size),
                "gate_proj": (c.hidden_size, c.intermediate_size),
                "up_proj": (c.hidden_size, c.intermediate_size),
                "down_proj": (c.intermediate_size, c.hidden_size)}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache,
                adapters: AdapterDelta | None = None) -> torch.Tensor:
        """Final hidden states ``[T, H]`` (after the last norm) for the batch's tokens."""
        x = self.embed[batch.token_ids]  # [T, H]
        for layer in self.layers:
            x = self._layer(layer, x, batch, cache, adapters)
        return _rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[N, V]`` in float32 for hidden states ``[N, H]``."""
        return F.linear(hidden, self.lm_head).float()

    def _layer(self, layer: DecoderLayer, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache,
               adapters: AdapterDelta | None) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        h = _rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [T, q + 2kv]
        self._add_deltas(qkv, layer.index, ("q_proj", "k_proj", "v_proj"), h, adapters)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rope(q, k, batch.positions)
        attn = paged_attention(q, k, v, layer.index, cache, batch, self.scale)  # [T, q]
        out = F.linear(attn, layer.o)
        self._add_delta(out, layer.index, "o_proj", attn, adapters)
        x = x + out
        h = _rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
        gate_up = F.linear(h, layer.gate_up)  # [T, 2I]
        self._add_deltas(gate_up, layer.index, ("gate_proj", "up_proj"), h, adapters)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        down = F.linear(act, layer.down)
        self._add_delta(down, layer.index, "down_proj", act, adapters)
        return x + down

    def _add_deltas(self, fused: torch.Tensor, layer: int, modules: tuple[str, ...], x: torch.Tensor,
                    adapters: AdapterDelta | None) -> None:
        if adapters is None:
            return
        for module in modules:
            d = adapters.delta(layer, module, x)
            if d is not None:
                _, start, end = self.fused_slices[module]
                fused[:, start:end] += d

    @staticmethod
    def _add_delta(out: torch.Tensor, layer: int, module: str, x: torch.Tensor,
                   adapters: AdapterDelta | None) -> None:
        if adapters is not None:
            d = adapters.delta(layer, module, x)
            if d is not None:
                out += d


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as HF's LlamaRMSNorm does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
