"""Write randomly initialised models in the real Hugging Face format.

``create_model`` builds the HF config class of the architecture, initialises the HF model class
with a fixed seed, and saves it with ``save_pretrained`` (safetensors, optionally sharded), plus a
``generation_config.json`` and the tokenizer from :mod:`coserve.model.tokenizer_builder`. So the
directory is exactly what ``transformers`` itself would write and reads back unchanged with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.

Initialisation: ``from_config`` applies the HF default init (weights normal with std
``initializer_range = 0.02``, biases zero, RMSNorm weights one). Two things about a random model
initialised that way make it a poor test subject, and :func:`shape_init` then rescales a few
tensors (deterministically, by constant factors that depend only on ``hidden_size``):

* Logits. The final RMSNorm output has unit RMS, so a logit's std is ``std(lm_head) *
  sqrt(hidden_size)``: 0.16 for the tiny preset, a near-uniform next-token distribution whose top
  candidates differ by round-off, so greedy decoding by two correct implementations could diverge.
  With untied embeddings ``lm_head.weight`` is scaled to std ``LOGIT_STD / sqrt(hidden_size)``
  (:data:`LOGIT_STD` = 3). With tied embeddings the matrix is also the input embedding, and scaling
  it would make the embedding swamp the residual stream (every position then predicts its own
  token), so the final ``norm.weight`` is set to ``LOGIT_STD / (0.02 * sqrt(hidden_size))``
  instead, and the residual writers ``o_proj`` and ``down_proj`` are scaled by
  :data:`TIED_RESIDUAL_GAIN` (10) so that the blocks, not the current token's embedding,
  dominate the residual stream. Typical logits then have std about 3 and the top two logits of a
  position differ by about 0.5 (rarely below 1e-3), far above float32 round-off.
* Attention. Scores ``q.k / sqrt(head_dim)`` have std ``std(W_q) * std(W_k) * hidden_size``, 0.03
  for the tiny preset: attention is uniform and RoPE or masking bugs barely show. ``q_proj`` and
  ``k_proj`` are scaled to std ``sqrt(ATTN_SCORE_STD / hidden_size)`` so scores have std about
  :data:`ATTN_SCORE_STD` (1), as in trained models. Qwen3 normalises q and k per head before the
  rotation, so its scores have std about 1 whatever the projections; its ``q_norm`` and ``k_norm``
  weights, all ones at init, are set to two different ramps (0.5 to 1.5 and back) so that a
  decoder which skipped them, or swapped them, would not match.

A tied random model still tends to fall into short loops under greedy decoding (its output feeds
back through the same matrix); an untied one produces varied text.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GenerationConfig, Glm4MoeConfig,
                          GptOssConfig, GraniteConfig, LlamaConfig, MistralConfig, MixtralConfig, Olmo2Config,
                          Olmo3Config, OlmoeConfig, Phi3Config, PreTrainedConfig, PreTrainedModel, Qwen2Config,
                          Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SeedOssConfig, SmolLM3Config)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import logging as hf_logging

from coserve.model.presets import (ARCHS, DTYPES, EXPERTS_PER_TOKEN, GLM_DENSE_LAYERS, GLM_EXPERTS, GLM_GROUPS,
                                   NUM_EXPERTS, ModelPreset, get_preset)
from coserve.model.tokenizer_builder import (BOS_ID, EOS_ID, IM_END_ID, PAD_ID, build_tokenizer,
                                             save_tokenizer)

#: Target standard deviation of the logits of a created model (see the module docstring).
LOGIT_STD = 3.0
#: Std of the normal init of every linear and embedding weight (the HF default).
INITIALIZER_RANGE = 0.02
#: Target standard deviation of the attention scores ``q.k / sqrt(head_dim)``.
ATTN_SCORE_STD = 1.0
#: Target standard deviation of a mixture-of-experts router's logits (see ``shape_init``).
ROUTER_LOGIT_STD = 2.0
#: With tied embeddings, ``o_proj`` and ``down_proj`` weights are scaled by this.
TIED_RESIDUAL_GAIN = 10.0
#: Standard deviation of q/k/v biases where a layer has them (HF initialises them to zeros, which would leave a
#: bias the engine forgot unnoticed by the parity tests)
QKV_BIAS_STD = 0.1
#: gpt-oss's SwiGLU limit in created models (gpt-oss's: 7), where a random model's gate/up values clamp
GLU_LIMIT = 0.25
#: Standard deviation of created gpt-oss models' sinks and biases (HF initialises the biases to zeros, the sinks near)
SINK_STD, GPT_OSS_BIAS_STD = 1.0, 0.1
#: GLM-4.5's router's correction bias, added to its sigmoid scores (each in (0, 1)) to choose a token's experts
ROUTER_BIAS_STD = 0.2


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else ``ValueError`` naming ``field``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{field}: unknown {field} {value!r} (choose from {', '.join(choices)})")
    return value


def _rope_parameters(preset: ModelPreset, arch: str, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """transformers-5 ``rope_parameters``: the preset's theta, or Llama-3 style scaling on top."""
    if rope_scaling is None:
        return {"rope_type": "default", "rope_theta": preset.rope_theta}
    if arch != "llama":
        raise ValueError(f"rope_scaling: only supported for arch 'llama', not {arch!r}")
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling: must be a dict, got {type(rope_scaling).__name__}")
    params: dict[str, Any] = {"rope_theta": preset.rope_theta, **rope_scaling}
    if "type" in params:  # the transformers-4 spelling
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    known = ("default", *ROPE_INIT_FUNCTIONS)
    if params["rope_type"] not in known:
        raise ValueError(f"rope_scaling: unknown rope_type {params['rope_type']!r} "
                         f"(choose from {', '.join(known)})")
    return params


def _check_shard_size(max_shard_size: str | int | None) -> None:
    """``ValueError`` naming ``max_shard_size`` unless it is None, a positive int or like ``"20MB"``."""
    if max_shard_size is None:
        return
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, (int, str)):
        ok = False
    elif isinstance(max_shard_size, int):
        ok = max_shard_size > 0
    else:
        ok = re.fullmatch(r"\s*\d+(\.\d+)?\s*[KMGT]B\s*", max_shard_size, re.IGNORECASE) is not None
    if not ok:
        raise ValueError(f"max_shard_size: expected a positive byte count or a size such as '20MB', "
                         f"got {max_shard_size!r}")


def build_config(preset: str = "tiny", arch: str = "llama", dtype: str = "float32",
                 tie_word_embeddings: bool | None = None,
                 rope_scaling: dict[str, Any] | None = None, head_dim: int | None = None) -> PreTrainedConfig:
    """The HF config (``LlamaConfig``, ``Qwen2Config``, ``MistralConfig``, ``Qwen3Config``, ``Phi3Config``,
    ``Gemma2Config``, ``Gemma3TextConfig``, ``GraniteConfig``, ``SeedOssConfig``, ...) ``create_model`` uses.

    Raises ``ValueError`` naming the field for an unknown preset, arch or dtype, or a bad
    ``rope_scaling`` or ``head_dim``.
    """
    p = get_preset(preset)
    _check_choice("arch", arch, ARCHS)
    _check_choice("dtype", dtype, DTYPES)
    if head_dim is None:
        head_dim = p.head_dim
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: must be a positive even integer, got {head_dim!r}")
    elif (arch in ("qwen2", "phi3", "granite", "smollm3", "olmo2", "olmo3", "olmoe", "qwen2_moe")
          and head_dim != p.head_dim):
        raise ValueError(f"head_dim: {arch} heads are hidden_size / num_attention_heads ({p.head_dim}) wide")
    tied = p.tie_word_embeddings if tie_word_embeddings is None else bool(tie_word_embeddings)
    common: dict[str, Any] = dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads, max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=p.rms_norm_eps, initializer_range=INITIALIZER_RANGE, hidden_act="silu",
        tie_word_embeddings=tied, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        rope_parameters=_rope_parameters(p, arch, rope_scaling), dtype=dtype,
    )
    try:
        if arch == "llama":
            cfg: PreTrainedConfig = LlamaConfig(**common, head_dim=head_dim, attention_bias=False,
                                                mlp_bias=False)
        elif arch == "qwen2":  # Qwen2 always has q/k/v biases
            cfg = Qwen2Config(**common, use_sliding_window=False)
        elif arch == "qwen3":  # no biases; q and k each RMS-normalised per head before the rotation
            cfg = Qwen3Config(**common, head_dim=head_dim, attention_bias=False, use_sliding_window=False)
        elif arch == "gemma3":  # see gemma3_config
            cfg = gemma3_config(common, p, head_dim)
        elif arch == "gemma2":  # see gemma2_config
            cfg = gemma2_config(common, p, head_dim)
        elif arch == "olmo2":  # norms of the outputs, not of the inputs; q and k each normalised over all heads
            cfg = Olmo2Config(**common)
        elif arch == "olmo3":  # OLMo 2's layer, alternately sliding over a sixteenth of the context (OLMo 3: three
            # layers in four, over 4,096 positions) and full; the full layers' RoPE YaRN-scaled (factor 2), the
            # sliding ones' plain, as OLMo 3 7B's (factor 8)
            cfg = Olmo3Config(**{k: v for k, v in common.items() if k != "rope_parameters"},
                              sliding_window=max(16, p.max_position_embeddings // 16),
                              layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(p.num_hidden_layers)],
                              rope_parameters={
                                  "sliding_attention": {"rope_type": "default", "rope_theta": p.rope_theta},
                                  "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": p.rope_theta,
                                                     "original_max_position_embeddings":
                                                         p.max_position_embeddings // 2}})
        elif arch == "smollm3":  # Llama's layer; every other layer without RoPE here (SmolLM3: every fourth)
            cfg = SmolLM3Config(**common, no_rope_layer_interval=2, use_sliding_window=False)
        elif arch == "granite":  # Llama's layer with multipliers (Granite 3: 12, 0.22, 1/128 and 8), set apart from 1
            cfg = GraniteConfig(**common, embedding_multiplier=4.0, residual_multiplier=0.5,
                                attention_multiplier=0.5 / math.sqrt(p.head_dim), logits_scaling=2.0)
        elif arch == "mixtral":  # Mistral's layer with a mixture of experts; top-k scores renormalised
            cfg = MixtralConfig(**common, head_dim=head_dim, sliding_window=None, num_local_experts=NUM_EXPERTS,
                                num_experts_per_tok=EXPERTS_PER_TOKEN)
        elif arch == "qwen3_moe":  # Qwen3's attention with experts of half the preset's MLP width; scores as they come
            cfg = Qwen3MoeConfig(**common, head_dim=head_dim, attention_bias=False, use_sliding_window=False,
                                 num_experts=NUM_EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, norm_topk_prob=False,
                                 moe_intermediate_size=p.expert_size(arch), decoder_sparse_step=1,
                                 mlp_only_layers=[])
        elif arch == "qwen2_moe":  # Qwen2's attention (q/k/v biases), experts as Qwen3-MoE's and a gated shared expert
            cfg = Qwen2MoeConfig(**{**common, "intermediate_size": p.intermediate_size}, qkv_bias=True,
                                 use_sliding_window=False, num_experts=NUM_EXPERTS,
                                 num_experts_per_tok=EXPERTS_PER_TOKEN, norm_topk_prob=False,
                                 moe_intermediate_size=p.expert_size(arch),
                                 shared_expert_intermediate_size=p.intermediate_size, decoder_sparse_step=1,
                                 mlp_only_layers=[])
        elif arch == "glm4_moe":  # GLM-4.5: q/k/v biases, q and k normalised per head, half of each head rotated;
            # the first layer dense, then experts routed by sigmoid scores and a correction bias within the better of
            # two groups, their weights renormalised and scaled (2.5, as GLM-4.5's), beside an ungated shared expert
            cfg = Glm4MoeConfig(**{**common, "rope_parameters": {**common["rope_parameters"],
                                                                  "partial_rotary_factor": 0.5}},
                                head_dim=head_dim, attention_bias=True, use_qk_norm=True,
                                moe_intermediate_size=p.expert_size(arch), n_routed_experts=GLM_EXPERTS,
                                num_experts_per_tok=EXPERTS_PER_TOKEN, n_shared_experts=1, n_group=GLM_GROUPS,
                                topk_group=1, first_k_dense_replace=GLM_DENSE_LAYERS, norm_topk_prob=True,
                                routed_scaling_factor=2.5, num_nextn_predict_layers=0)
        elif arch == "gpt_oss":  # gpt-oss: every other layer sliding (the first), sinks, biases on q/k/v and the
            # output projection, experts with biases and a clamped SwiGLU (its limit low enough here to clamp some of a
            # random model's values, as gpt-oss's 7 clamps a trained one's), YaRN (truncate off, as gpt-oss's)
            cfg = GptOssConfig(**{k: v for k, v in common.items() if k not in ("rope_parameters", "intermediate_size")},
                               intermediate_size=p.expert_size(arch), head_dim=head_dim, attention_bias=True,
                               num_local_experts=NUM_EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
                               sliding_window=max(16, p.max_position_embeddings // 16),
                               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(p.num_hidden_layers)],
                               swiglu_limit=GLU_LIMIT,
                               rope_parameters={"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                "truncate": False, "rope_theta": p.rope_theta,
                                                "original_max_position_embeddings": p.max_position_embeddings // 2})
        elif arch == "olmoe":  # Llama's layer, q and k each normalised over all their heads, experts as Qwen3-MoE's
            cfg = OlmoeConfig(**{**common, "intermediate_size": p.expert_size(arch)}, num_experts=NUM_EXPERTS,
                              num_experts_per_tok=EXPERTS_PER_TOKEN, norm_topk_prob=False, clip_qkv=None)
        elif arch == "seed_oss":  # Llama's layer with q/k/v biases (Seed-OSS-36B: dropouts of 0.1 in training)
            cfg = SeedOssConfig(**common, head_dim=head_dim, attention_bias=True, attention_out_bias=False,
                                mlp_bias=False, attention_dropout=0.0, residual_dropout=0.0)
        elif arch == "phi3":  # q/k/v in one matrix (qkv_proj), gate and up in another (gate_up_proj)
            cfg = Phi3Config(**common, original_max_position_embeddings=p.max_position_embeddings,
                             sliding_window=None)
        else:
            cfg = MistralConfig(**common, head_dim=head_dim, sliding_window=None)
    except (TypeError, ValueError, KeyError) as e:
        field = "rope_scaling" if rope_scaling is not None else "preset"
        raise ValueError(f"{field}: invalid {arch} config ({type(e).__name__}: {e})") from e
    return cfg


def gemma3_config(common: dict[str, Any], p: ModelPreset, head_dim: int) -> PreTrainedConfig:
    """Gemma 3 (text) of the preset's shape: layers alternately sliding over a sixteenth of the context and attending
    to all of it (Gemma 3 slides five layers in six, over 512 of 32,768 positions), the sliding ones rotated by RoPE
    of theta 10,000, the full ones by the preset's theta with linear scaling (factor 2; Gemma 3 4B and up: 8), and
    q.k scaled by (2 * head_dim) ** -0.5 (``query_pre_attn_scalar``; 256 = head_dim in Gemma 3 1B), so that a decoder
    reading any of these wrong does not match."""
    kwargs = {k: v for k, v in common.items() if k not in ("hidden_act", "rope_parameters")}
    return Gemma3TextConfig(
        **kwargs, head_dim=head_dim, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=2 * head_dim,
        sliding_window=max(16, p.max_position_embeddings // 16),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(p.num_hidden_layers)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": p.rope_theta}})


def gemma2_config(common: dict[str, Any], p: ModelPreset, head_dim: int) -> PreTrainedConfig:
    """Gemma 2 of the preset's shape: every other layer sliding over a sixteenth of the context (Gemma 2: 4,096 of
    8,192), q.k scaled by (2 * head_dim) ** -0.5, and the scores and the logits soft-capped at 2 and 5 (Gemma 2: 50 and
    30, which a random model's small scores and logits would barely reach: these caps bend them, so that a decoder
    that skipped them would not match)."""
    kwargs = {k: v for k, v in common.items() if k != "hidden_act"}
    return Gemma2Config(
        **kwargs, head_dim=head_dim, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=2 * head_dim,
        sliding_window=max(16, p.max_position_embeddings // 16), attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(p.num_hidden_layers)])


def shape_init(model: PreTrainedModel) -> None:
    """Rescale a freshly initialised float32 model in place for stable, sharp outputs.

    Scales q/k projections (attention scores of std ~:data:`ATTN_SCORE_STD`) and the output
    projection (logits of std ~:data:`LOGIT_STD`); see the module docstring for the reasoning.
    """
    cfg = model.config
    hidden = cfg.hidden_size
    qk_gain = math.sqrt(ATTN_SCORE_STD / hidden) / INITIALIZER_RANGE
    tied = bool(cfg.tie_word_embeddings)
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            if hasattr(layer.self_attn, "qkv_proj"):  # Phi-3: q's and k's rows of the fused matrix
                q_and_k = (cfg.num_attention_heads + cfg.num_key_value_heads) * layer.self_attn.head_dim
                layer.self_attn.qkv_proj.weight[:q_and_k].mul_(qk_gain)
            else:
                layer.self_attn.q_proj.weight.mul_(qk_gain)
                layer.self_attn.k_proj.weight.mul_(qk_gain)
                gen = torch.Generator().manual_seed(1000 + index)
                for name in ("q_proj", "k_proj", "v_proj"):  # Qwen2's and Seed-OSS's biases, set apart from zero
                    bias = getattr(layer.self_attn, name).bias
                    if bias is not None:
                        bias.copy_(torch.randn(bias.shape, generator=gen) * QKV_BIAS_STD)
            if hasattr(layer.self_attn, "q_norm"):  # Qwen3's per-head norms (OLMo 2's over all heads; see above)
                q_norm, k_norm = layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight
                q_norm.copy_(torch.linspace(0.5, 1.5, q_norm.numel()))
                k_norm.copy_(torch.linspace(0.5, 1.5, k_norm.numel()).flip(0))
            if hasattr(layer, "post_feedforward_layernorm") and not hasattr(layer, "pre_feedforward_layernorm"):
                for j, name in enumerate(("post_attention_layernorm", "post_feedforward_layernorm")):  # OLMo 2's
                    weight = getattr(layer, name).weight
                    weight.copy_(torch.linspace(0.7, 1.3, weight.numel()).roll(j * weight.numel() // 2))
            if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma's four norms (1 + w: zeros at init), told apart
                for j, name in enumerate(("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                          "post_feedforward_layernorm")):
                    weight = getattr(layer, name).weight
                    weight.copy_(torch.linspace(-0.3, 0.3, weight.numel()).roll(j * weight.numel() // 4))
            moe = getattr(layer, "block_sparse_moe", None) or layer.mlp
            if hasattr(moe, "experts"):  # a router (HF initialises Qwen3-MoE's to zeros): logits of std
                # ROUTER_LOGIT_STD, so that each token's top experts stand apart by far more than round-off
                gen = torch.Generator().manual_seed(index)
                router = moe.router if hasattr(moe, "router") else moe.gate  # gpt-oss's name
                router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * ROUTER_LOGIT_STD
                                    / math.sqrt(hidden))
                bias = getattr(router, "e_score_correction_bias", None)
                if bias is not None:  # GLM-4.5's (zeros at init): enough to change some tokens' experts
                    bias.copy_(torch.randn(bias.shape, generator=gen) * ROUTER_BIAS_STD)
                for name in ("bias", "gate_up_proj_bias", "down_proj_bias"):  # gpt-oss's router's and experts'
                    bias = getattr(router if name == "bias" else moe.experts, name, None)
                    if bias is not None:
                        bias.copy_(torch.randn(bias.shape, generator=gen) * GPT_OSS_BIAS_STD)
            sinks = getattr(layer.self_attn, "sinks", None)
            if sinks is not None:  # gpt-oss's, one logit a head beside the scores (std ATTN_SCORE_STD)
                sinks.copy_(torch.randn(sinks.shape, generator=torch.Generator().manual_seed(2000 + index))
                            * SINK_STD)
            o_bias = getattr(layer.self_attn.o_proj, "bias", None)
            if o_bias is not None:  # gpt-oss's
                o_bias.copy_(torch.randn(o_bias.shape, generator=torch.Generator().manual_seed(3000 + index))
                             * GPT_OSS_BIAS_STD)
            if tied:
                layer.self_attn.o_proj.weight.mul_(TIED_RESIDUAL_GAIN)
                (moe.experts.down_proj if hasattr(moe, "experts") else layer.mlp.down_proj.weight).mul_(
                    TIED_RESIDUAL_GAIN)
        if tied:  # Gemma's norm scales by 1 + w
            gemma = hasattr(model.model.layers[0], "pre_feedforward_layernorm")
            model.model.norm.weight.fill_(LOGIT_STD / (INITIALIZER_RANGE * math.sqrt(hidden)) - gemma)
        else:
            model.get_output_embeddings().weight.mul_(LOGIT_STD / (INITIALIZER_RANGE * math.sqrt(hidden)))


def _generation_config() -> GenerationConfig:
    """Stops at ``<|end_of_text|>`` and at ChatML's ``<|im_end|>``."""
    return GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID)


def create_model(out_dir: str | Path, preset: str = "tiny", arch: str = "llama", seed: int = 0,
                 dtype: str = "float32", max_shard_size: str | int | None = None,
                 tie_word_embeddings: bool | None = None,
                 rope_scaling: dict[str, Any] | None = None, head_dim: int | None = None) -> Path:
    """Write a randomly initialised HF causal LM into ``out_dir`` and return that path.

    The directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (or,
    when ``max_shard_size`` such as ``"20MB"`` is given, ``model-0000i-of-0000n.safetensors``
    shards and ``model.safetensors.index.json``), ``tokenizer.json`` and ``tokenizer_config.json``.
    The same arguments always give the same weights; the weights depend on ``seed``.

    ``preset`` is a name in :data:`coserve.model.presets.PRESETS` (``tiny``, ``small``, ``medium``), ``arch``
    one of ``llama``, ``qwen2``, ``mistral``, ``qwen3``, ``phi3``, ``gemma2``, ``gemma3``, ``granite``, ``smollm3``,
    ``olmo2``, ``dtype`` one of ``float32``, ``bfloat16``, ``float16``. ``tie_word_embeddings`` overrides the
    preset's choice. ``rope_scaling`` (llama only) sets transformers-5 ``rope_parameters``, e.g. ``{"rope_type":
    "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings":
    128}``; ``rope_theta`` defaults to the preset's. ``head_dim`` (llama, mistral, qwen3, gemma2, gemma3) sets each
    head's width apart from ``hidden_size / num_attention_heads``, as Qwen3 and Llama-3.2 checkpoints do. Raises
    ``ValueError`` naming the offending field.
    """
    cfg = build_config(preset, arch, dtype, tie_word_embeddings, rope_scaling, head_dim)
    _check_shard_size(max_shard_size)
    p = get_preset(preset)
    tokenizer = build_tokenizer(p.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    cfg.dtype = "float32"  # initialise (and rescale) in float32, whatever dtype is written
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    shape_init(model)
    model = model.to(getattr(torch, dtype)).eval()
    model.config.dtype = dtype
    model.generation_config = _generation_config()
    save_kwargs: dict[str, Any] = {}  # transformers 5 always writes safetensors
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a few kilobytes
    try:
        model.save_pretrained(str(out), **save_kwargs)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    save_tokenizer(tokenizer, out, model_max_length=p.max_position_embeddings)
    return out
