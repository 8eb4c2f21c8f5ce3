"""The model's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The HF architectures coserve runs, and what each implies for the decoder.
# ``qk_norm``: q and k RMS-normalised over each head (weights ``q_norm``/``k_norm`` of ``head_dim``) before the
# rotation.
# ``fused``: q/k/v and gate/up stored (and adapted) as one module each, ``qkv_proj`` and ``gate_up_proj`` (Phi-3).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False, "fused": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True, "fused": False},
    "Phi3ForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": True},
    "GraniteForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": False},
    "SmolLM3ForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": False},
    "Olmo2ForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": False},
    "Gemma2ForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": False},
    "Gemma3ForCausalLM": {"qkv_bias": False, "qk_norm": True, "fused": False},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": False},
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True, "fused": False},
    "OlmoeForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": False},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "qk_norm": False, "fused": False},
    "SeedOssForCausalLM": {"qkv_bias": True, "qk_norm": False, "fused": False},
    "Olmo3ForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": False},
    "Glm4MoeForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": False},  # read: attention_bias, use_qk_norm
    "GptOssForCausalLM": {"qkv_bias": True, "qk_norm": False, "fused": False},  # attention_bias: o_proj's too
}
MOES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM", "Glm4MoeForCausalLM",
        "GptOssForCausalLM")
ROUTERS = ("softmax", "sigmoid")  # ModelConfig.router
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


class ModelConfigError(ValueError):
    """A model directory whose config.json coserve cannot run."""


@dataclass(slots=True)
class RopeConfig:
    """Rotary embedding parameters (plain RoPE, linear, Llama-3 or YaRN frequency scaling, or Phi-3's LongRoPE)."""

    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # llama3, linear: how much longer the new context is (linear: every frequency divided by it)
    low_freq_factor: float = 1.0  # llama3: wavelengths above orig/low are scaled by 1/factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below orig/high are kept
    original_max_position_embeddings: int = 8192  # llama3, longrope: the pre-scaling context
    # the first fraction of each head's dimensions that rotates (Phi-3's partial_rotary_factor); the rest pass through
    partial_rotary_factor: float = 1.0
    # longrope: each frequency divided by short_factor's (contexts up to original_max_position_embeddings) or
    # long_factor's (past it: ``ModelConfig.long_rope_from``), cos and sin multiplied by attention_factor
    # (transformers' default: sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings / original where
    # the config gives none)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # yarn (Qwen2.5/3's long contexts, gpt-oss): frequencies blended between interpolated (divided by factor) and
    # kept, over the dimensions between beta_fast and beta_slow rotations within the original context (their bounds
    # rounded out where truncate), cos and sin multiplied by attention_factor (0.1 ln(factor) + 1, or mscale's ratio)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(slots=True)
class ModelConfig:
    """Everything the decoder needs to know about a checkpoint's shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    torch_dtype: str  # the dtype the checkpoint was saved in
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before the rotation
    # each layer's sliding window (tokens: a query attends to the last so many positions, its own included), None
    # for a layer that attends to its whole context (Mistral's sliding_window, Qwen2's and Qwen3's
    # use_sliding_window and layer_types, Phi-3's sliding_window); empty where no layer slides
    attention_windows: tuple[int | None, ...] = ()
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj, each one module of the checkpoint and of its adapters
    # Gemma 2 and 3: the embedding scaled by sqrt(hidden_size); every norm's weight 1 + w, applied in float32 before the
    # cast; the attention's and the MLP's outputs each normalised before their residual add (post_attention and
    # post_feedforward norms; the MLP's input norm is pre_feedforward_layernorm); the MLP gated by tanh-approximated
    # GELU; scores scaled by query_pre_attn_scalar ** -0.5; the sliding layers rotated by their own RoPE (rope_local)
    gemma: bool = False
    attn_scale: float | None = None  # the scores' scale; None: head_dim ** -0.5
    rope_local: RopeConfig | None = None  # the sliding layers' RoPE, where it differs from ``rope`` (Gemma 3)
    attn_softcap: float | None = None  # Gemma 2: scores capped at cap * tanh(s / cap) before the softmax
    final_softcap: float | None = None  # Gemma 2 (Gemma 3 where set): logits capped likewise
    # Granite: the embedding times embedding_multiplier, each block's attention and MLP output times
    # residual_multiplier before its residual add, the logits divided by logits_scaling (None: 1, no operation)
    embed_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    nope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose q and k are not rotated (no position encoding)
    # OLMo 2: no norms of the attention's and the MLP's inputs, each output normalised before its residual add (norm
    # weights applied in float32 before the cast), and q and k each RMS-normalised over all their heads at once
    olmo2: bool = False
    # OLMo 2 and OLMoE: q and k each RMS-normalised over all their heads at once (weights [Hq * D] and [Hkv * D])
    qk_norm_whole: bool = False
    # Mixtral, Qwen3-MoE, OLMoE: every layer's MLP is ``num_experts`` SiLU-gated experts of ``intermediate_size``, each
    # token through the ``experts_per_token`` its router scores highest (softmax in float32), weighted by those
    # scores, renormalised to sum to one where ``norm_topk_prob`` (Mixtral always); Mixtral weighs the experts'
    # outputs by the float32 scores, Qwen3-MoE casts them to the model's dtype first (``moe_weights_float32``)
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = False
    moe_weights_float32: bool = False
    # Qwen2-MoE: beside the experts, a shared SiLU-gated expert of this width that every token runs through, its output
    # scaled by sigmoid(h @ shared_expert_gate) (0: none); GLM-4.5's shared experts (``shared_experts``, as one of
    # their summed width) add theirs unscaled (``shared_expert_gated`` False)
    shared_expert_size: int = 0
    shared_expert_gated: bool = True
    # GLM-4.5 (DeepSeek-V3's routing): the router's logits (in float32) go through a sigmoid, not a softmax; each
    # token's experts are the highest of those scores plus the layer's ``e_score_correction_bias`` among the
    # ``topk_groups`` of ``expert_groups`` groups whose two best such scores sum highest; their weights are the scores
    # themselves (renormalised where ``norm_topk_prob``), times ``routed_scaling``
    router: str = "softmax"  # one of ROUTERS
    expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    # a mixture's layers whose MLP is one dense SiLU-gated MLP of ``dense_intermediate_size`` (GLM-4.5's first
    # ``first_k_dense_replace``; Qwen-MoE's ``mlp_only_layers``, and those ``decoder_sparse_step`` skips)
    dense_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    # gpt-oss: per-head sink logits in each attention's softmax (``sinks``: a column of the denominator, no value),
    # a bias on the output projection beside q/k/v's, the norms' weights applied in float32 before the cast; its
    # router's logits biased; each expert's gate/up and down biased, gate and up interleaved in the checkpoint, its
    # gate clamped above and up on both sides at ``glu_limit``, the two joined as ``(up + 1) * gate *
    # sigmoid(glu_alpha * gate)`` (0: SiLU's ``silu(gate) * up``)
    attn_sinks: bool = False
    o_bias: bool = False
    norms_float32: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    glu_alpha: float = 0.0
    glu_limit: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.attention_windows and len(self.attention_windows) != self.num_layers:
            raise ModelConfigError(f"config.json: {len(self.attention_windows)} attention windows for "
                                   f"{self.num_layers} layers")
        if any(w is not None and w <= 0 for w in self.attention_windows):
            raise ModelConfigError(f"config.json: sliding_window must be positive, got {self.sliding_window}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.rope.rope_type not in ROPE_TYPES:
            raise ModelConfigError(
                f"config.json: rope type {self.rope.rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
        if not 0 < self.rope.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ModelConfigError(f"config.json: partial_rotary_factor {self.rope.partial_rotary_factor} leaves "
                                   f"{self.rotary_dim} of {self.head_dim} dimensions to rotate (an even, positive "
                                   "number is needed)")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ModelConfigError(f"config.json: num_experts_per_tok must be 1 to {self.num_experts}, got "
                                   f"{self.experts_per_token}")
        if self.router not in ROUTERS:
            raise ModelConfigError(f"config.json: router {self.router!r} is not one of {', '.join(ROUTERS)}")
        if self.num_experts and (self.expert_groups <= 0 or self.num_experts % self.expert_groups):
            raise ModelConfigError(f"config.json: n_group {self.expert_groups} does not divide the "
                                   f"{self.num_experts} experts into equal groups")
        if self.num_experts and (not 0 < self.topk_groups <= self.expert_groups or self.topk_groups * (
                self.num_experts // self.expert_groups) < self.experts_per_token):
            raise ModelConfigError(f"config.json: topk_group {self.topk_groups} of n_group {self.expert_groups} "
                                   f"leaves fewer than num_experts_per_tok ({self.experts_per_token}) of "
                                   f"{self.num_experts} experts to choose from")
        if self.dense_layers and self.dense_intermediate_size <= 0:
            raise ModelConfigError("config.json: intermediate_size (the dense layers' MLP width) must be positive")
        for name in ("short_factor", "long_factor") if self.rope.rope_type == "longrope" else ():
            n = len(getattr(self.rope, name))
            if n != self.rotary_dim // 2:
                raise ModelConfigError(f"field 'rope_scaling': {name} has {n} values; the model rotates "
                                       f"{self.rotary_dim} dimensions, so {self.rotary_dim // 2} are needed")

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions rotate (the first: HF's ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    @property
    def input_norms(self) -> bool:
        """Whether each layer normalises the attention's and the MLP's inputs (all but OLMo 2)."""
        return not self.olmo2

    @property
    def output_norms(self) -> bool:
        """Whether each layer normalises the attention's and the MLP's outputs before their residual adds (Gemma 2
        and 3, OLMo 2)."""
        return self.gemma or self.olmo2

    @property
    def activation(self) -> str:
        """The MLP gate's activation: ``silu``, or ``gelu_tanh`` (Gemma's tanh-approximated GELU)."""
        return "gelu_tanh" if self.gemma else "silu"

    @property
    def per_chunk_attention(self) -> bool:
        """Whether attention needs each chunk's own call (Gemma 2's capped scores, gpt-oss's sinks), not CUDA's one
        variable-length call over every chunk (``build_forward_batch``'s ``varlen``), nor decode graphs of it. A
        sliding window needs neither: the variable-length kernel masks it (its ``window_size``)."""
        return self.attn_softcap is not None or self.attn_sinks

    @property
    def moe(self) -> bool:
        """Whether the model's MLPs are mixtures of experts (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GLM-4.5), in every
        layer but ``dense_layers``."""
        return self.num_experts > 0

    def moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def sliding_window(self) -> int | None:
        """The shortest window a layer slides over, or None where every layer attends to its whole context."""
        return min((w for w in self.attention_windows if w is not None), default=None)

    @property
    def kv_window(self) -> int | None:
        """How far back any layer reads the KV cache where every layer slides: the longest window (a running
        sequence's blocks wholly behind it are freed); None where a layer attends to its whole context (Gemma 2
        and 3, which alternate the two, keep every block)."""
        windows = self.attention_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)

    @property
    def pooled_window(self) -> int | None:
        """Where sliding layers sit beside whole-context ones (Gemma 2 and 3; Qwen with ``max_window_layers``): the
        longest of their windows (their K/V live in a pool of their own, ``kvcache/window_pool.py``). None where no
        layer slides or every layer does."""
        windows = self.attention_windows
        sliding = [w for w in windows if w is not None]
        return max(sliding) if sliding and len(sliding) < len(windows) else None

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The layers that attend to a sliding window."""
        return tuple(i for i, w in enumerate(self.attention_windows) if w is not None)

    def attention_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None where it attends to its whole context."""
        return self.attention_windows[layer] if self.attention_windows else None

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE's original context where the model runs past it: a sequence whose prompt is longer, and every
        token at or past that position, rotate by the long factors (``model/rope.py``). None for any other model."""
        n = self.rope.original_max_position_embeddings
        return n if self.rope.rope_type == "longrope" and n < self.max_position_embeddings else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``model_dir/config.json``; raises ModelConfigError naming the file and field."""
        path = Path(model_dir) / "config.json"
        raw = read_json_file(path, "the model directory", ModelConfigError)
        try:
            return cls.from_dict(raw)
        except ModelConfigError as e:
            raise ModelConfigError(f"{path}: {e}") from e

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of an HF config.json (transformers 4.x and 5.x spellings)."""
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"field 'architectures': {arch!r} is not supported; "
                f"coserve runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["moe_intermediate_size" if arch in ("Qwen3MoeForCausalLM",
                                                                              "Qwen2MoeForCausalLM",
                                                                              "Glm4MoeForCausalLM")
                                          else "intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=bool(raw.get("qkv_bias" if arch == "Qwen2MoeForCausalLM" else "attention_bias",
                                      SUPPORTED_ARCHITECTURES[arch]["qkv_bias"])),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                rope=_rope_from_dict(_gemma_rope(raw, "full_attention") if arch == "Gemma3ForCausalLM" else
                                     _olmo3_rope(raw, "full_attention") if arch == "Olmo3ForCausalLM" else
                                     {"rope_theta": 2_000_000.0, **raw} if arch == "SmolLM3ForCausalLM" else
                                     # Glm4MoeConfig's defaults: half of each head rotates, theta 10,000
                                     {"rope_theta": 10_000.0, "partial_rotary_factor": 0.5, **raw}
                                     if arch == "Glm4MoeForCausalLM" else raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_id_list(raw.get("eos_token_id")),
                qk_norm=(bool(raw.get("use_qk_norm", False)) if arch == "Glm4MoeForCausalLM"
                         else SUPPORTED_ARCHITECTURES[arch]["qk_norm"]),
                attention_windows=_attention_windows(raw, arch),
                fused=SUPPORTED_ARCHITECTURES[arch]["fused"],
                **(_gemma_fields(raw, arch) if arch in GEMMAS else {}),
                **(_granite_fields(raw) if arch == "GraniteForCausalLM" else {}),
                nope_layers=_nope_layers(raw) if arch == "SmolLM3ForCausalLM" else (),
                olmo2=arch in ("Olmo2ForCausalLM", "Olmo3ForCausalLM"),
                **(_gpt_oss_fields(raw) if arch == "GptOssForCausalLM" else {}),
                qk_norm_whole=arch in ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoeForCausalLM"),
                **({"rope_local": _rope_from_dict(_olmo3_rope(raw, "sliding_attention"))}
                   if arch == "Olmo3ForCausalLM" else {}),
                **(_moe_fields(raw, arch) if arch in MOES else {}),
            )
            _check_activation(raw, "gelu_pytorch_tanh" if arch in GEMMAS else "silu")
            _check_biases(raw, arch)
        except KeyError as e:
            raise ModelConfigError(f"missing field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                raise
            raise ModelConfigError(f"a field has the wrong type ({e})") from e
        return cfg


MISTRAL_DEFAULT_WINDOW = 4096  # transformers' MistralConfig where config.json has no sliding_window
GEMMAS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _attention_windows(raw: dict[str, Any], arch: str) -> tuple[int | None, ...]:
    """``ModelConfig.attention_windows`` as transformers reads the config: Mistral slides every layer over
    ``sliding_window`` (4096 where the field is absent, none where it is null); Qwen2 and Qwen3 slide only with
    ``use_sliding_window`` (off in their released checkpoints), the layers ``layer_types`` names (from
    ``max_window_layers`` on, in configs without them); other kinds of layer are refused, naming the field. Phi-3
    slides every layer where ``sliding_window`` is set. Llama's layers attend to their whole context. Empty where no
    layer slides."""
    layers = int(raw.get("num_hidden_layers", 0))
    if arch in GEMMAS:  # layer_types, else every sliding_window_pattern-th layer full (Gemma 2: every other)
        pattern = int(raw.get("sliding_window_pattern", 6 if arch == "Gemma3ForCausalLM" else 2))
        kinds = raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                           for i in range(layers)]
        return _windows_of(kinds, raw.get("sliding_window", 4096), layers)
    if arch == "GptOssForCausalLM":  # layer_types, else every other layer sliding (the first), over 128 positions
        kinds = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(layers)]
        return _windows_of(kinds, raw.get("sliding_window", 128), layers)
    if arch == "Olmo3ForCausalLM":  # layer_types, else three layers in four sliding (each fourth full)
        kinds = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                           for i in range(layers)]
        return _windows_of(kinds, raw.get("sliding_window", 4096), layers)
    if arch == "SmolLM3ForCausalLM":  # with use_sliding_window, layer_types (else its NoPE layers) slide
        if not raw.get("use_sliding_window") or not raw.get("sliding_window"):
            return ()
        nope = set(_nope_layers(raw))
        kinds = raw.get("layer_types") or ["sliding_attention" if i in nope else "full_attention"
                                           for i in range(layers)]
        return _windows_of(kinds, raw.get("sliding_window"), layers)
    # every layer, where set (Phi-3-mini-4k: 2047; Mixtral's released checkpoints: null)
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        window = raw.get("sliding_window", MISTRAL_DEFAULT_WINDOW if arch == "MistralForCausalLM" else None)
        return (int(window),) * layers if window else ()
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not raw.get("use_sliding_window"):
        return ()
    kinds = raw.get("layer_types")
    if kinds is None:
        first = int(raw.get("max_window_layers", 0))
        kinds = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    return _windows_of(kinds, raw.get("sliding_window"), layers)


def _windows_of(kinds: list, window: int | None, layers: int) -> tuple[int | None, ...]:
    """Each layer's window from its kind in ``layer_types`` (empty where none slides); other kinds refused."""
    for i, kind in enumerate(kinds):
        if kind not in ("full_attention", "sliding_attention"):
            raise ModelConfigError(f"field 'layer_types': layer {i} is {kind!r}; full_attention and "
                                   "sliding_attention are supported")
    if not window or "sliding_attention" not in kinds:
        return ()
    if len(kinds) != layers:
        raise ModelConfigError(f"field 'layer_types': {len(kinds)} entries for {layers} layers")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)


def _check_biases(raw: dict[str, Any], arch: str) -> None:
    """Biases coserve's layers do not add are refused, naming the field: on the attention's output projection (the
    ``attention_bias`` of Llama and the others puts one there beside q/k/v's, which gpt-oss's layer adds; Qwen2's,
    Seed-OSS's and GLM-4.5's are q/k/v's alone; Seed-OSS's ``attention_out_bias``) and on the MLP's (``mlp_bias``)."""
    if raw.get("attention_bias") and arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "SeedOssForCausalLM",
                                                  "Glm4MoeForCausalLM", "GptOssForCausalLM"):
        raise ModelConfigError("field 'attention_bias': biases on q/k/v and the output projection are not supported")
    for name in ("attention_out_bias", "mlp_bias"):
        if raw.get(name):
            raise ModelConfigError(f"field {name!r}: a bias there is not supported")


def _check_activation(raw: dict[str, Any], expected: str) -> None:
    """The MLP's gate runs ``expected`` (SiLU; Gemma's tanh-approximated GELU); another activation is refused,
    naming the field."""
    name = "hidden_activation" if "hidden_activation" in raw else "hidden_act"
    act = raw.get(name, expected)
    if act != expected:
        raise ModelConfigError(f"field {name!r}: {act!r} is not supported (this model's MLP runs {expected})")


def _gemma_rope(raw: dict[str, Any], kind: str) -> dict[str, Any]:
    """``raw`` with Gemma 3's RoPE of one kind of layer (``full_attention`` or ``sliding_attention``) as a plain
    ``rope_parameters`` (transformers 5 nests them by kind; 4.x has ``rope_theta``/``rope_scaling`` for the full
    layers and ``rope_local_base_freq`` for the sliding ones)."""
    nested = raw.get("rope_parameters") or {}
    if kind in nested:
        return {**raw, "rope_parameters": nested[kind], "rope_scaling": None}
    if kind == "sliding_attention":
        return {**raw, "rope_parameters": {"rope_type": "default",
                                           "rope_theta": raw.get("rope_local_base_freq", 10000.0)},
                "rope_scaling": None}
    return {**raw, "rope_parameters": None, "rope_theta": raw.get("rope_theta", 1_000_000.0)}


def _olmo3_rope(raw: dict[str, Any], kind: str) -> dict[str, Any]:
    """``raw`` with OLMo 3's RoPE of one kind of layer as a plain ``rope_parameters``: transformers 5 nests them by
    kind; in 4.x spelling ``rope_scaling`` (YaRN in OLMo 3) is the full layers' alone, and both kinds share
    ``rope_theta`` (500,000 where absent)."""
    nested = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", 500_000.0)
    if kind in nested:
        return {**raw, "rope_parameters": {"rope_theta": theta, **nested[kind]}, "rope_scaling": None}
    if kind == "sliding_attention":
        return {**raw, "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None}
    return {**raw, "rope_parameters": None, "rope_theta": theta}


def _gemma_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """``ModelConfig``'s Gemma 2 and 3 fields as transformers reads them: Gemma 2 caps the attention scores and the
    logits (50 and 30 where the fields are absent); Gemma 3 caps the logits where ``final_logit_softcapping`` is set
    and never the scores (its attention ignores ``attn_logit_softcapping``), and rotates its sliding layers by their own
    RoPE. Bidirectional attention is refused, naming the field."""
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError("field 'use_bidirectional_attention': only causal attention is supported")
    fields: dict[str, Any] = {"gemma": True, "attn_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5}
    if arch == "Gemma2ForCausalLM":
        fields["attn_softcap"] = _positive_or_none(raw, "attn_logit_softcapping", 50.0)
        fields["final_softcap"] = _positive_or_none(raw, "final_logit_softcapping", 30.0)
    else:
        fields["final_softcap"] = _positive_or_none(raw, "final_logit_softcapping", None)
        fields["rope_local"] = _rope_from_dict(_gemma_rope(raw, "sliding_attention"))
    return fields


def _moe_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """``ModelConfig``'s mixture-of-experts fields as transformers reads them (OLMoE's as Qwen3-MoE's; GLM-4.5's
    ``_glm4_moe_fields``)."""
    if arch == "MixtralForCausalLM":
        return {"num_experts": int(raw.get("num_local_experts", 8)),
                "experts_per_token": int(raw.get("num_experts_per_tok", 2)), "norm_topk_prob": True,
                "moe_weights_float32": True}
    if arch == "Glm4MoeForCausalLM":
        return _glm4_moe_fields(raw)
    if arch == "GptOssForCausalLM":  # the top-k logits' softmax: the softmax's top-k renormalised
        return {"num_experts": int(raw.get("num_local_experts", 128)),
                "experts_per_token": int(raw.get("num_experts_per_tok", 4)), "norm_topk_prob": True}
    if raw.get("clip_qkv") is not None:  # OLMoE's option (null in its released checkpoints)
        raise ModelConfigError(f"field 'clip_qkv': clamping q, k and v ({raw['clip_qkv']}) is not supported")
    if raw.get("use_sliding_window"):
        raise ModelConfigError("field 'use_sliding_window': sliding layers are not supported in a mixture of experts")
    # the released checkpoints' num_experts; transformers 5 writes it as num_local_experts
    experts = raw.get("num_experts", raw.get("num_local_experts", 128))
    fields = {"num_experts": int(experts), "experts_per_token": int(raw.get("num_experts_per_tok", 8)),
              "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
              "shared_expert_size": int(raw.get("shared_expert_intermediate_size", 0))
              if arch == "Qwen2MoeForCausalLM" else 0}
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        fields.update(_qwen_dense_layers(raw))
    return fields


def _gpt_oss_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's layer beyond Llama's (transformers' ``GptOssConfig`` defaults where a field is absent): sinks, the
    output projection's bias (with q/k/v's, ``attention_bias``), float32 norm weights, and its experts' biases and
    clamped, shifted SwiGLU."""
    alpha, limit = float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0))
    if alpha <= 0 or limit <= 0:
        raise ModelConfigError(f"fields 'swiglu_alpha' and 'swiglu_limit' must be positive, got {alpha} and {limit}")
    return {"attn_sinks": True, "o_bias": bool(raw.get("attention_bias", True)), "norms_float32": True,
            "router_bias": True, "expert_bias": True, "glu_alpha": alpha, "glu_limit": limit}


def _qwen_dense_layers(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen-MoE's layers with a dense MLP, as transformers builds them: those in ``mlp_only_layers``, and those whose
    number plus one ``decoder_sparse_step`` does not divide; their MLP of ``intermediate_size``."""
    layers = int(raw.get("num_hidden_layers", 0))
    step = int(raw.get("decoder_sparse_step", 1))
    if step <= 0:
        raise ModelConfigError(f"field 'decoder_sparse_step': must be positive, got {step}")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in only):
        raise ModelConfigError(f"field 'mlp_only_layers': must list layers 0 to {layers - 1}, got {only!r}")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return {"dense_layers": dense, "dense_intermediate_size": int(raw["intermediate_size"]) if dense else 0}


def _glm4_moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's mixture (transformers' ``Glm4MoeConfig`` defaults where a field is absent): sigmoid routing with a
    correction bias among groups of experts, ``n_shared_experts`` ungated shared experts, and the first
    ``first_k_dense_replace`` layers dense. Its multi-token prediction layers (``num_nextn_predict_layers``, stored as
    layers past ``num_hidden_layers``) are not run, as transformers does not run them."""
    layers = int(raw.get("num_hidden_layers", 0))
    first_dense = int(raw.get("first_k_dense_replace", 1))
    if not 0 <= first_dense <= layers:
        raise ModelConfigError(f"field 'first_k_dense_replace': must be 0 to {layers}, got {first_dense}")
    size = int(raw.get("moe_intermediate_size", 1408))
    return {"num_experts": int(raw.get("n_routed_experts", 128)),
            "experts_per_token": int(raw.get("num_experts_per_tok", 8)),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", True)), "moe_weights_float32": True,
            "shared_expert_size": size * int(raw.get("n_shared_experts", 1)), "shared_expert_gated": False,
            "router": "sigmoid", "expert_groups": int(raw.get("n_group", 1)),
            "topk_groups": int(raw.get("topk_group", 1)),
            "routed_scaling": float(raw.get("routed_scaling_factor", 1.0)),
            "dense_layers": tuple(range(first_dense)),
            "dense_intermediate_size": int(raw.get("intermediate_size", 10944)) if first_dense else 0}


def _nope_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: ``no_rope_layers`` (1: rotated, 0: not), else every
    ``no_rope_layer_interval``-th layer (4 where absent)."""
    layers = int(raw.get("num_hidden_layers", 0))
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ModelConfigError(f"field 'no_rope_layers': {len(flags)} entries for {layers} layers")
    return tuple(i for i, rotated in enumerate(flags) if not rotated)


def _granite_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers (transformers' defaults, 1, where absent); q.k scaled by ``attention_multiplier``."""
    fields = {}
    for name, field_name in (("embedding_multiplier", "embed_multiplier"), ("residual_multiplier",
                                                                           "residual_multiplier"),
                             ("logits_scaling", "logits_scaling"), ("attention_multiplier", "attn_scale")):
        value = _positive_or_none(raw, name, 1.0)
        fields[field_name] = None if value == 1.0 and name != "attention_multiplier" else value
    return fields


def _positive_or_none(raw: dict[str, Any], name: str, default: float | None) -> float | None:
    value = raw.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelConfigError(f"field {name!r}: must be a positive number or null, got {value!r}")
    return float(value)


def read_json_file(path: Path, where: str, error: type[ValueError]) -> dict:
    """A JSON object from ``path``; ``error`` naming the file when it is missing or not valid JSON."""
    if not path.is_file():
        raise error(f"{path}: no {path.name} in {where}")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from e


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _rope_from_dict(raw: dict[str, Any]) -> RopeConfig:
    """RoPE settings from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("su", "yarn") and (raw.get("architectures") or [None])[0] == "Phi3ForCausalLM":
        rope_type = "longrope"  # Phi3Config's reading of the older names
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if rope_type == "longrope":
        return _longrope(raw, params, theta, partial)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params.get("factor", 1.0)),
                          partial_rotary_factor=partial)
    if rope_type == "yarn":
        return _yarn(raw, params, theta, partial)
    if rope_type != "llama3":
        return RopeConfig(theta=theta, rope_type=rope_type, partial_rotary_factor=partial)
    try:
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            partial_rotary_factor=partial,
        )
    except KeyError as e:
        raise ModelConfigError(f"field 'rope_scaling': llama3 scaling needs {e.args[0]!r}") from e


def _yarn(raw: dict[str, Any], params: dict[str, Any], theta: float, partial: float) -> RopeConfig:
    """YaRN as transformers computes it (``_compute_yarn_parameters``): the original context from the config's own
    ``original_max_position_embeddings``, else the scaling's, else ``max_position_embeddings``; ``factor``
    required (None: their ratio); the attention factor from ``factor`` (and ``mscale``/``mscale_all_dim`` where both
    are given) unless set."""
    if "factor" not in params:
        raise ModelConfigError("field 'rope_scaling': yarn needs 'factor'")
    original = raw.get("original_max_position_embeddings",
                       params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 2048)))
    factor = params["factor"]
    factor = float(int(raw.get("max_position_embeddings", 2048)) / int(original) if factor is None else factor)
    if factor <= 0:
        raise ModelConfigError(f"field 'rope_scaling': yarn's factor must be positive, got {factor}")

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else get_mscale(factor))
    return RopeConfig(theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=int(original),
                      partial_rotary_factor=partial, attention_factor=float(attention),
                      beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      truncate=bool(params.get("truncate", True)))


def _longrope(raw: dict[str, Any], params: dict[str, Any], theta: float, partial: float) -> RopeConfig:
    """Phi-3's LongRoPE as transformers computes it: short factors within the original context, long ones past it
    (both required, as transformers requires them)."""
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    short, long = params.get("short_factor"), params.get("long_factor")
    if original is None:
        raise ModelConfigError("field 'rope_scaling': longrope needs 'original_max_position_embeddings'")
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if not isinstance(factors, list) or not all(isinstance(f, (int, float)) and not isinstance(f, bool)
                                                     for f in factors):
            raise ModelConfigError(f"field 'rope_scaling': longrope's {name} must be a list of numbers, "
                                   f"got {factors!r}")
    original = int(original)
    attention = params.get("attention_factor")
    if attention is None:
        factor = params.get("factor") or int(raw.get("max_position_embeddings", 2048)) / original
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(theta=theta, rope_type="longrope", original_max_position_embeddings=original,
                      partial_rotary_factor=partial, short_factor=tuple(float(f) for f in short),
                      long_factor=tuple(float(f) for f in long),
                      attention_factor=float(attention))
