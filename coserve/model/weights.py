"""Reading Hugging Face safetensors checkpoints (one file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from coserve.model.config import ModelConfig
from coserve.model.moe import expert_names, fused_expert_names, router_bias_name, router_name, shared_expert_names


class WeightLoadError(ValueError):
    """A checkpoint whose weight files are missing, corrupt, or do not fit the config."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or ``model.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise WeightLoadError(f"{f}: shard named in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise WeightLoadError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are supported)")


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint on the CPU, keyed by their HF names."""
    model_dir = Path(model_dir)
    state: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(model_dir):
        try:
            state.update(load_file(str(f), device="cpu"))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise WeightLoadError(f"{f}: cannot read safetensors file ({e})") from e
    return state


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and shapes a checkpoint of this config must hold."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    dense = cfg.dense_intermediate_size if cfg.moe else i  # a dense MLP's width (in a mixture, its dense layers')
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
        })
        moe = cfg.moe_layer(layer)
        if moe:  # a router and each expert's gate, up and down
            shapes[router_name(cfg, layer)] = (cfg.num_experts, h)
            if cfg.router == "sigmoid":  # GLM-4.5's correction bias
                shapes[router_bias_name(layer)] = (cfg.num_experts,)
            if cfg.router_bias:  # gpt-oss's bias of the logits
                shapes[p + "mlp.router.bias"] = (cfg.num_experts,)
            if cfg.expert_bias:  # gpt-oss: every expert in one tensor each, with their biases
                e = cfg.num_experts
                shapes.update(zip(fused_expert_names(layer), ((e, h, 2 * i), (e, 2 * i), (e, i, h), (e, h))))
            for e in range(0 if cfg.expert_bias else cfg.num_experts):
                gate, up, down = expert_names(cfg, layer, e)
                shapes.update({gate: (i, h), up: (i, h), down: (h, i)})
            if cfg.shared_expert_size:  # the shared expert (Qwen2-MoE's and its gate)
                s = cfg.shared_expert_size
                gate, up, down, scale = shared_expert_names(cfg, layer)
                shapes.update({gate: (s, h), up: (s, h), down: (h, s)})
                if scale is not None:
                    shapes[scale] = (1, h)
        else:
            shapes[p + "mlp.down_proj.weight"] = (h, dense)
        if cfg.fused:  # Phi-3: q, k and v in one matrix, gate and up in another
            shapes[p + "self_attn.qkv_proj.weight"] = (cfg.q_size + 2 * cfg.kv_size, h)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * dense, h)
        else:
            shapes.update({
                p + "self_attn.q_proj.weight": (cfg.q_size, h),
                p + "self_attn.k_proj.weight": (cfg.kv_size, h),
                p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            })
            if not moe:
                shapes.update({p + "mlp.gate_proj.weight": (dense, h), p + "mlp.up_proj.weight": (dense, h)})
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.attn_sinks:
            shapes[p + "self_attn.sinks"] = (cfg.num_heads,)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
        if cfg.input_norms:  # OLMo 2 normalises no layer's input
            shapes[p + "input_layernorm.weight"] = (h,)
        if cfg.gemma:  # the MLP's input and output norms (its post_attention_layernorm: the attention's output)
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
        if cfg.output_norms:
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if cfg.qk_norm_whole:  # q's and k's norms over all their heads (OLMo 2, OLMoE)
            shapes[p + "self_attn.q_norm.weight"] = (cfg.q_size,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.kv_size,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
    return shapes


def check_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig, model_dir: Path) -> None:
    """Raise WeightLoadError naming the first missing or misshapen tensor."""
    for name, shape in expected_shapes(cfg).items():
        if name not in state:
            raise WeightLoadError(f"{model_dir}: tensor {name!r} is missing from the checkpoint")
        if tuple(state[name].shape) != shape:
            raise WeightLoadError(
                f"{model_dir}: tensor {name!r} has shape {tuple(state[name].shape)}, "
                f"config.json implies {shape}")
