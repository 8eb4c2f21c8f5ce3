"""The Llama-family decoder (Llama, Qwen2, Mistral, Qwen3) over flat, unpadded token batches."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from coserve.model.attention import PagedKVCache, paged_attention
from coserve.model.attention_spec import AttentionSpec
from coserve.model.config import ModelConfig
from coserve.model.forward_batch import ForwardBatch
from coserve.model.linear_modules import (MIXTRAL_EXPERT_NAMES, ROUTER, SHARED_EXPERT_MODULES, V4_EXPERT_NAMES,
                                          ExpertShapes, shared_expert_shapes)
from coserve.model.moe import (expert_names, fused_expert_names, moe_mlp, router_bias_name, router_name,
                               shared_expert_names)
from coserve.model.row_invariant import elementwise_sigmoid
from coserve.model.norm_grad import rms_norm_stats
from coserve.model.packed_gemm import PackedWeights, gemm_backend
from coserve.model.rope import RotaryEmbedding
from coserve.model.tiled_gemm import padded_rows, split_linear

# Attention over a layer's new tokens: (q [T, Hq, D], k, v [T, Hkv, D], layer) -> [T, Hq * D].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class Bypass(Protocol):
    """Adapters acting on the frozen linear modules (LoRA, IA3; implemented in ``coserve.peft``)."""

    modules: frozenset[str]  # the modules it touches anywhere

    def input(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
        """The input the module's matmul sees (only for INPUT_SCALABLE_MODULES)."""
        ...

    def output(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The module's output given its input ``x`` ``[T, in]`` and frozen output ``y`` ``[T, out]``."""
        ...

    def output_keep(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``output`` plus the tensor its backward will read, over the rows it trains (only called when a tap is
        given: every row of ``x`` for a trainable bypass; a co-served forward's finetuning rows, ``RowSplitBypass``)."""
        ...

    def expert_output(self, layer: int, module: str, expert: int, rows: torch.Tensor, x: torch.Tensor,
                      y: torch.Tensor) -> torch.Tensor:
        """A mixture's ``expert`` (only for ``EXPERT_MODULES`` in ``modules``): its ``module``'s output given its input
        ``x`` ``[P, in]`` and frozen output ``y`` ``[P, out]``, over the batch's rows ``rows`` ``[n]`` then ``P - n``
        padding rows (``moe.moe_mlp``)."""
        ...

    def expert_output_keep(self, layer: int, module: str, expert: int, rows: torch.Tensor, x: torch.Tensor,
                           y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``expert_output`` plus the tensor its backward reads for each of ``rows`` ``[n, r]`` (zeros for rows it
        does not train), or None."""
        ...


# CPU GEMMs round a row differently depending on the other rows when there are few of them (measured:
# 1-5 rows differed from the same rows inside a larger call; from 8 rows on they matched bitwise in every
# case tried, given MKL's strict mode: see coserve/model/batch_invariance.py). Inference batches run over at
# least this many rows, alone or beside a finetuning window, so that a concurrent finetuning job cannot
# change an inference output.
BATCH_INVARIANT_ROWS = 8


class DecoderLayer:
    """One transformer block's frozen weights, with q/k/v and gate/up fused for fewer matmuls."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], index: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        p = f"model.layers.{index}."

        def w(name: str) -> torch.Tensor:
            return state[p + name].to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            """A norm's weight: Gemma's 1 + w and OLMo 2's w kept in float32 (``rms_norm`` applies them before the
            cast, as their HF norms do), else in the model's dtype."""
            if cfg.gemma:
                return (1 + state[p + name].float()).to(device)
            return state[p + name].float().to(device) if cfg.olmo2 or cfg.norms_float32 else w(name)

        self.index = index
        # the attention's input norm, and the MLP's (Gemma's pre_feedforward_layernorm; its post_attention_layernorm
        # normalises the attention's output instead); OLMo 2 normalises neither input
        self.input_norm = norm("input_layernorm.weight") if cfg.input_norms else None
        self.post_norm = (norm("pre_feedforward_layernorm.weight" if cfg.gemma else "post_attention_layernorm.weight")
                          if cfg.input_norms else None)
        # Gemma and OLMo 2: the attention's and the MLP's outputs, each normalised before its residual add
        self.attn_out_norm = norm("post_attention_layernorm.weight") if cfg.output_norms else None
        self.mlp_out_norm = norm("post_feedforward_layernorm.weight") if cfg.output_norms else None
        # in float32 for their backward (the same tensors in a float32 model; else one copy, not one per window)
        self.input_norm_f32 = self.input_norm.float() if self.input_norm is not None else None
        self.post_norm_f32 = self.post_norm.float() if self.post_norm is not None else None
        self.qkv = gemm_layout(w("self_attn.qkv_proj.weight") if cfg.fused else  # [q + 2kv, H]
                               torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                                          w("self_attn.v_proj.weight")]))
        self.qkv_bias = (torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"),
                                    w("self_attn.v_proj.bias")]) if cfg.qkv_bias else None)
        # Qwen3: each head of q and k RMS-normalised before the rotation; both weights as one [Hq + Hkv, D] (the
        # rows of a head repeated), so that q and k side by side are normalised in one pass
        self.qk_norm = self.qk_norm_f32 = self.k_weight = None
        if cfg.qk_norm:
            self.qk_norm = torch.cat([norm("self_attn.q_norm.weight").expand(cfg.num_heads, -1),
                                      norm("self_attn.k_norm.weight").expand(cfg.num_kv_heads, -1)])
            self.qk_norm_f32 = self.qk_norm.float()
            self.k_weight = self.qkv[cfg.q_size:cfg.q_size + cfg.kv_size]  # k before its norm, for its backward
        # OLMo 2, OLMoE: q and k each normalised over all their heads at once (weights [1, Hq * D] and [1, Hkv * D])
        self.q_norm_whole = self.k_norm_whole = None
        if cfg.qk_norm_whole:
            self.q_norm_whole = norm("self_attn.q_norm.weight").unsqueeze(0)
            self.k_norm_whole = norm("self_attn.k_norm.weight").unsqueeze(0)
            self.k_weight = self.qkv[cfg.q_size:cfg.q_size + cfg.kv_size]
        self.o = gemm_layout(w("self_attn.o_proj.weight"))
        self.o_bias = w("self_attn.o_proj.bias") if cfg.o_bias else None  # gpt-oss's
        # gpt-oss: each head's sink logit, in the attention's softmax (AttentionSpec.sinks)
        self.sinks = tuple(state[p + "self_attn.sinks"].float().tolist()) if cfg.attn_sinks else None
        # Mixtral, Qwen3-MoE: the router [E, H] and each expert's fused gate/up [2I, H] and down [H, I] (moe.py), in
        # place of the one MLP (GLM-4.5: the router in float32, as transformers keeps it, and its correction bias [E])
        self.router, self.router_bias, self.expert_gate_up, self.expert_down = None, None, [], []
        # gpt-oss: its router's logits' bias [E], and each expert's gate/up [2I] and down [H] biases
        self.router_logit_bias, self.expert_gate_up_bias, self.expert_down_bias = None, None, None
        # Qwen2-MoE: the shared expert's fused gate/up [2S, H] and down [H, S], and its gate [1, H] (GLM-4.5: none)
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        self.gate_up = self.down = self.gate_weight = self.up_weight = None
        if cfg.moe_layer(index):
            sigmoid = cfg.router == "sigmoid"
            self.router = gemm_layout(state[router_name(cfg, index)].to(
                device=device, dtype=torch.float32 if sigmoid else dtype))
            if sigmoid:
                self.router_bias = state[router_bias_name(index)].to(device=device, dtype=torch.float32)
            if cfg.router_bias:
                self.router_logit_bias = w("mlp.router.bias")
            if cfg.expert_bias:  # gpt-oss: all experts in one tensor each, gate and up interleaved
                self._fused_experts(cfg, state, index, device, dtype)
            for e in range(0 if cfg.expert_bias else cfg.num_experts):
                gate, up, down = (state[n].to(device=device, dtype=dtype) for n in expert_names(cfg, index, e))
                self.expert_gate_up.append(gemm_layout(torch.cat([gate, up])))
                self.expert_down.append(gemm_layout(down))
            if cfg.shared_expert_size:
                gate, up, down, scale = (None if n is None else state[n].to(device=device, dtype=dtype)
                                         for n in shared_expert_names(cfg, index))
                self.shared_gate_up = gemm_layout(torch.cat([gate, up]))
                self.shared_down = gemm_layout(down)
                self.shared_gate = None if scale is None else gemm_layout(scale)
        else:  # a dense MLP (in a mixture, GLM-4.5's first layers': dense_layers)
            self.gate_up = gemm_layout(w("mlp.gate_up_proj.weight") if cfg.fused else  # [2I, H]
                                       torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
            self.down = gemm_layout(w("mlp.down_proj.weight"))
            self.gate_weight, self.up_weight = self.gate_up.chunk(2)
        # Views of the fused weights that a finetuning backward recomputes alone (one object each, so that a
        # packed copy can be found for them: coserve/model/packed_gemm.py).
        self.q_weight = self.qkv[:cfg.q_size]

    def _fused_experts(self, cfg: ModelConfig, state: dict[str, torch.Tensor], index: int, device: torch.device,
                       dtype: torch.dtype) -> None:
        """gpt-oss's experts as the others' are held: each one's gate rows, then its up rows ``[2I, H]`` (the
        checkpoint's ``[H, 2I]`` columns alternate gate and up) and its down ``[H, I]``, with their biases."""
        gate_up, gate_up_bias, down, down_bias = (state[n].to(device=device, dtype=dtype)
                                                  for n in fused_expert_names(index))
        self.expert_gate_up_bias, self.expert_down_bias = [], []
        for e in range(cfg.num_experts):
            self.expert_gate_up.append(gemm_layout(torch.cat([gate_up[e, :, 0::2].t(), gate_up[e, :, 1::2].t()])))
            self.expert_gate_up_bias.append(torch.cat([gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]]))
            self.expert_down.append(gemm_layout(down[e].t()))
            self.expert_down_bias.append(down_bias[e].contiguous())

    def frozen_weights(self) -> tuple[torch.Tensor, ...]:
        """The matmul weights, and the views of them a backward recomputes alone."""
        if self.router is not None:
            experts = (self.router, *self.expert_gate_up, *self.expert_down,
                       *(w for w in (self.shared_gate_up, self.shared_down, self.shared_gate) if w is not None))
            return self.qkv, self.o, *experts, self.q_weight, *((self.k_weight,) if self.k_weight is not None else ())
        views = (self.q_weight, self.gate_weight, self.up_weight) + ((self.k_weight,) if self.k_weight is not None
                                                                      else ())
        return self.qkv, self.o, self.gate_up, self.down, *views


def gemm_layout(weight: torch.Tensor) -> torch.Tensor:
    """A frozen ``[out, in]`` weight, stored column-major on CPU (each input feature's outputs contiguous).

    The values and shape are unchanged; ``F.linear(x, w)`` then multiplies by a row-major ``[in, out]``
    matrix, which CPU BLAS runs up to twice as fast for the few rows of decode and finetuning windows
    (measured here: 512x2816 at 8 rows 0.19 ms against 0.36 ms). CUDA keeps the usual layout.
    """
    return weight.t().contiguous().t() if weight.device.type == "cpu" else weight


class DecoderModel:
    """Embeddings, decoder layers, final norm and LM head of a causal LM.

    ``forward`` runs any mix of sequences' new tokens in one call: each row of the
    flat batch attends to its own sequence's cached prefix through the paged cache.
    """

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_positions: int, pack_gemms: bool = True) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.embed = state["model.embed_tokens.weight"].to(device=device, dtype=dtype)
        # Gemma: embeddings scaled by sqrt(hidden_size), the factor cast to the model's dtype first (as HF)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(device=device, dtype=dtype) if cfg.gemma else None
        self.lm_head = (self.embed if cfg.tie_word_embeddings  # the embedding's own rows: gathered by token
                        else gemm_layout(state["lm_head.weight"].to(device=device, dtype=dtype)))
        self.norm = ((1 + state["model.norm.weight"].float()).to(device) if cfg.gemma  # as DecoderLayer's norms
                     else state["model.norm.weight"].float().to(device) if cfg.norms_float32
                     else state["model.norm.weight"].to(device=device, dtype=dtype))
        self.norm_f32 = self.norm.float()  # for the finetuning head's backward, as DecoderLayer's
        self.layers = [DecoderLayer(cfg, state, i, device, dtype) for i in range(cfg.num_layers)]
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, device, dtype, cfg.rotary_dim,
                                    cfg.long_rope_from)
        self.long_rope_from = self.rope.long_from  # LongRoPE's original context where its long rows are built
        #   (rope_row)
        local = (RotaryEmbedding(cfg.rope_local, cfg.head_dim, max_positions, device, dtype, cfg.rotary_dim)
                 if cfg.rope_local is not None else self.rope)
        # each layer's rotation (Gemma 3's sliding layers have their own)
        # (None: SmolLM3's layers without position encoding)
        self.ropes = [None if i in cfg.nope_layers else
                      local if cfg.rope_local is not None and cfg.attention_window(i) is not None else self.rope
                      for i in range(cfg.num_layers)]
        # the MLP's gate: SiLU, or Gemma's tanh-approximated GELU (HF's gelu_pytorch_tanh)
        self.act = functools.partial(F.gelu, approximate="tanh") if cfg.activation == "gelu_tanh" else F.silu
        # each layer's attention: scale, sliding window (None: its whole context), Gemma 2's cap on the scores
        self.attention = [AttentionSpec(cfg.scale, cfg.attention_window(i), cfg.attn_softcap, layer.sinks)
                          for i, layer in enumerate(self.layers)]
        self.gemm_tile_rows = 0  # > 0: inference rows run in calls of whole tiles (coserve/model/tiled_gemm.py)
        self.packed: PackedWeights | None = None
        self.pack_gemms(gemm_backend(device, dtype) if pack_gemms else None)

    def pack_gemms(self, backend: str | None) -> None:
        """Frozen weights run packed for ``backend`` (MKL or oneDNN: CPU, float32; ``coserve/model/packed_gemm.py``)
        from now on, or plain where None; packs are made on first use."""
        self.packed = PackedWeights(backend) if backend is not None else None
        if self.packed is not None:
            self.packed.allow(self.lm_head, *(w for layer in self.layers for w in layer.frozen_weights()))

    @property
    def gemms(self) -> str:
        """How the frozen weights' matmuls run: ``<backend>-packed`` or ``plain`` (a latency fit's key has it)."""
        return f"{self.packed.backend}-packed" if self.packed is not None else "plain"

    def padded_rows(self, rows: int) -> int:
        """The rows of the matmul calls that ``rows`` inference rows run in, alone or beside a finetuning window."""
        return padded_rows(rows, BATCH_INVARIANT_ROWS, self.gemm_tile_rows)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               split: int = 0) -> torch.Tensor:
        """A frozen weight's matmul; with tiles on, a fused forward's rows ``[:split]`` (the inference rows and
        their padding) in a call of their own. By the weight's pack where there is one (never with tiles: those
        are for CUDA)."""
        if self.packed is not None and not self.gemm_tile_rows:
            return self.packed.linear(x, weight, bias)
        return split_linear(x, weight, bias, split if self.gemm_tile_rows else 0)

    def input_grad(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``dy @ weight``: the gradient at a frozen weight's input given the gradient ``dy`` at its output."""
        return self.packed.input_grad(dy, weight) if self.packed is not None else dy @ weight

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of every adapter-targetable linear module, by the model's own names (Phi-3:
        ``qkv_proj`` and ``gate_up_proj``, each one module; ``coserve/model/linear_modules.py``)."""
        c = self.cfg
        h, i = c.hidden_size, c.intermediate_size
        if c.moe:  # the router; the experts' matrices are no modules: PEFT adapts them as parameters (expert_shapes).
            # Qwen2-MoE's shared expert's modules; not GLM-4.5's (PEFT 0.21 on transformers 5 reads its gate_proj,
            # up_proj, down_proj and all-linear as the experts' parameters, and adapts neither its shared experts nor
            # its dense layers' MLPs with them), nor its dense layers' MLPs
            shared = shared_expert_shapes(h, c.shared_expert_size) if c.shared_expert_gated else {}
            # gpt-oss's router: no module PEFT adapts (its all-linear is the attention alone)
            router = {} if c.architecture == "GptOssForCausalLM" else {ROUTER: (h, c.num_experts)}
            return {"q_proj": (h, c.q_size), "k_proj": (h, c.kv_size), "v_proj": (h, c.kv_size),
                    "o_proj": (c.q_size, h), **router, **shared}
        if c.fused:
            return {"qkv_proj": (h, c.q_size + 2 * c.kv_size), "o_proj": (c.q_size, h), "gate_up_proj": (h, 2 * i),
                    "down_proj": (i, h)}
        return {"q_proj": (h, c.q_size), "k_proj": (h, c.kv_size), "v_proj": (h, c.kv_size), "o_proj": (c.q_size, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def expert_shapes(self) -> ExpertShapes | None:
        """A mixture's adaptable expert parameters (PEFT's ``target_parameters``: each expert's fused gate/up
        ``(H, 2I)`` and down ``(I, H)``), or None for a dense model."""
        c = self.cfg
        if not c.moe:
            return None
        h, i = c.hidden_size, c.intermediate_size
        gpt_oss = c.architecture == "GptOssForCausalLM"  # no transformers 4 names; gate and up interleaved
        names = (MIXTRAL_EXPERT_NAMES if c.architecture == "MixtralForCausalLM" else () if gpt_oss
                 else V4_EXPERT_NAMES)
        layers = tuple(j for j in range(c.num_layers) if c.moe_layer(j)) if c.dense_layers else ()
        return ExpertShapes(c.num_experts, {"experts.gate_up_proj": (h, 2 * i), "experts.down_proj": (i, h)},
                            bool(c.shared_expert_size) and c.shared_expert_gated, names, layers, gpt_oss)

    def module_weight(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The frozen ``[out, in]`` weight and the bias (or None) of one targetable module (views of the fused ones)."""
        c, lay = self.cfg, self.layers[layer]
        bounds = {"q_proj": (0, c.q_size), "k_proj": (c.q_size, c.q_size + c.kv_size),
                  "v_proj": (c.q_size + c.kv_size, c.q_size + 2 * c.kv_size),
                  "qkv_proj": (0, c.q_size + 2 * c.kv_size)}
        if module in bounds:
            lo, hi = bounds[module]
            return lay.qkv[lo:hi], None if lay.qkv_bias is None else lay.qkv_bias[lo:hi]
        weights = {"o_proj": lay.o, "gate_proj": lay.gate_weight, "up_proj": lay.up_weight, "down_proj": lay.down,
                   "gate_up_proj": lay.gate_up, ROUTER: lay.router}
        if lay.shared_gate_up is not None:  # Qwen2-MoE's shared expert
            weights.update(zip(SHARED_EXPERT_MODULES, (*lay.shared_gate_up.chunk(2), lay.shared_down, lay.shared_gate)))
        return weights[module], lay.o_bias if module == "o_proj" else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache, bypass: Bypass | None = None,
                min_rows: int = 0) -> torch.Tensor:
        """Final hidden states ``[T, H]`` (after the last norm) for the batch's tokens.

        With ``min_rows`` the matmuls run over at least that many rows (zero rows past the batch,
        which attention skips and the result drops; a ``bypass`` must then cover them too): from
        ``padded_rows(1)`` rows on, a row's result does not depend on the others.
        """
        t = batch.num_tokens
        pad = max(0, min_rows - t)

        def attend(q, k, v, layer):
            out = paged_attention(q[:t], k[:t], v[:t], layer, cache, batch, self.attention[layer])
            return torch.cat([out, out.new_zeros(pad, out.shape[1])]) if pad else out

        x = self.embed_tokens(batch.token_ids)  # [T, H]
        positions = batch.positions
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        for layer in self.layers:
            x, _, _ = self.layer_forward(layer, x, positions, attend, bypass)
        return self.final_norm(x[:t])

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The layers' input ``[T, H]`` for ``token_ids`` (Gemma's scaled by sqrt(hidden_size), Granite's by its
        ``embedding_multiplier``)."""
        x = self.embed[token_ids]
        if self.cfg.embed_multiplier is not None:  # Granite
            return x * self.cfg.embed_multiplier
        return x if self.embed_scale is None else x * self.embed_scale

    def final_norm(self, x: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps, stats)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[N, V]`` in float32 for hidden states ``[N, H]`` (Gemma 2's soft-capped,
        ``cap * tanh(z / cap)``)."""
        logits = self.linear(hidden, self.lm_head).float()
        if self.cfg.logits_scaling is not None:  # Granite
            logits = logits / self.cfg.logits_scaling
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def layer_forward(self, layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor, attend: Attend,
                      bypass: Bypass | None, tap: Tap | None = None, split: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder block over rows ``x`` ``[T, H]``; returns its output and the rows' rotated K and V.

        Inference passes paged attention as ``attend``; finetuning passes attention over a
        window's cached prefix, and a ``tap`` that stores what its backward will read
        (the two norms' statistics ``rms_attn`` and ``rms_mlp``, ``q`` rotated, ``resid`` after attention,
        ``gate``, ``up``, and each bypassed module's own kept tensor under the module's name). One definition
        serves both. ``split``: a fused forward's inference rows with their padding (``linear``).
        """
        cfg, i = self.cfg, layer.index
        linear = functools.partial(self.linear, split=split)
        rope = self.ropes[i]
        t = x.shape[0]
        h = self.input_norm(x, layer.input_norm, tap, "rms_attn")
        qkv = bypass_output(bypass, tap, i, "qkv_proj", h, linear(h, layer.qkv, layer.qkv_bias))  # Phi-3's bypass
        q0, k0, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = bypass_output(bypass, tap, i, "q_proj", h, q0)
        k = bypass_output(bypass, tap, i, "k_proj", h, k0)
        v = bypass_output(bypass, tap, i, "v_proj", h, v)
        if layer.q_norm_whole is not None:  # OLMo 2, OLMoE: over all of q's heads, and of k's
            q, k = rms_norm(q, layer.q_norm_whole, cfg.rms_norm_eps), rms_norm(k, layer.k_norm_whole, cfg.rms_norm_eps)
            q, k = q.reshape(t, cfg.num_heads, cfg.head_dim), k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if rope is not None:
                q, k = rope(q, k, positions)
        elif q is q0 and k is k0:  # side by side in the projection's output: rotated in one pass (half the kernels)
            qk = qkv[:, :cfg.q_size + cfg.kv_size].unflatten(1, (-1, cfg.head_dim))
            if layer.qk_norm is not None:
                qk = self.head_norm(qk, layer.qk_norm, tap)
            q, k = (qk if rope is None else rope.rotate(qk, positions)).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        else:
            q, k = q.reshape(t, cfg.num_heads, cfg.head_dim), k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if layer.qk_norm is not None:
                q = self.head_norm(q, layer.qk_norm[:cfg.num_heads], tap, "q")
                k = self.head_norm(k, layer.qk_norm[cfg.num_heads:], tap, "k")
            if rope is not None:
                q, k = rope(q, k, positions)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if tap is not None:
            tap("q", q)
        attn = bypassed_linear(bypass, tap, i, "o_proj", attend(q, k, v, i), layer.o, linear, layer.o_bias)
        if layer.attn_out_norm is not None:  # Gemma
            attn = rms_norm(attn, layer.attn_out_norm, cfg.rms_norm_eps)
        x = x + (attn if cfg.residual_multiplier is None else attn * cfg.residual_multiplier)  # Granite's
        if tap is not None:
            tap("resid", x)
        h = self.input_norm(x, layer.post_norm, tap, "rms_mlp")
        if layer.router is not None:  # a mixture of experts: adapters of its router and its experts (expert_shapes)
            # the router over every row, as the other matmuls; each expert over its rows in calls of their own. A
            # bypass's kept tensor of the router goes to the tap as "moe.router" (its PEFT name, "gate", is the dense
            # MLP's gate output among the kept tensors)
            logits = bypass_output(bypass, tap and _renamed(tap, ROUTER, "moe.router"), i, ROUTER, h,
                                   linear(h.to(layer.router.dtype), layer.router,  # GLM-4.5's: in float32
                                          layer.router_logit_bias))
            biases = (layer.expert_gate_up_bias, layer.expert_down_bias) if layer.expert_down_bias else None
            mlp = moe_mlp(cfg, h, logits, layer.expert_gate_up, layer.expert_down, self.linear, self.act,
                          self.padded_rows, tap, bypass, i, layer.router_bias, biases)
            if layer.shared_gate_up is not None:  # the shared expert, over every row (Qwen2-MoE's gated)
                mlp = mlp + self.shared_expert(layer, h, linear, bypass, tap)[0]
            return x + mlp, k, v
        gate0, up0 = bypass_output(bypass, tap, i, "gate_up_proj", h, linear(h, layer.gate_up)).chunk(2, dim=-1)
        gate = bypass_output(bypass, tap, i, "gate_proj", h, gate0)
        up = bypass_output(bypass, tap, i, "up_proj", h, up0)
        if gate is not gate0:
            # back into one [T, 2I] buffer: the activation then reads gate as without a bypass, every row on its own
            # (a CPU kernel run over one contiguous block computes a few elements by its scalar path, whose bits
            # differ, and which elements depends on the row count: co-served rows would round unlike alone ones)
            gate, up = torch.cat([gate, up], dim=-1).chunk(2, dim=-1)
        if tap is not None:
            tap("gate", gate)
            tap("up", up)
        mlp = bypassed_linear(bypass, tap, i, "down_proj", self.act(gate) * up, layer.down, linear)
        if layer.mlp_out_norm is not None:  # Gemma
            mlp = rms_norm(mlp, layer.mlp_out_norm, cfg.rms_norm_eps)
        return x + (mlp if cfg.residual_multiplier is None else mlp * cfg.residual_multiplier), k, v

    def shared_expert(self, layer: DecoderLayer, h: torch.Tensor, linear: Callable[..., torch.Tensor] | None = None,
                      bypass: Bypass | None = None, tap: Tap | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The shared expert over rows ``h``: its gated output ``[T, H]``, and what its backward reads: the gate/up
        product ``[T, 2S]``, the ungated output and the gate's sigmoid ``[T, 1]`` (None: GLM-4.5's, ungated). A
        ``bypass`` of Qwen2-MoE's modules (``SHARED_EXPERT_MODULES``: its gate, up and down projections, and its gate)
        acts as on a dense MLP's."""
        linear, i = linear or self.linear, layer.index
        gu = linear(h, layer.shared_gate_up)
        gate0, up0 = gu.chunk(2, dim=-1)
        gate_module, up_module, down_module, gate_z = SHARED_EXPERT_MODULES
        gate = bypass_output(bypass, tap, i, gate_module, h, gate0)
        up = bypass_output(bypass, tap, i, up_module, h, up0)
        if gate is not gate0 or up is not up0:  # one buffer again, as the dense MLP's (each row's activation alike)
            gu = torch.cat([gate, up], dim=-1)
        gate, up = gu.chunk(2, dim=-1)
        out = bypassed_linear(bypass, tap, i, down_module, self.act(gate) * up, layer.shared_down, linear)
        if layer.shared_gate is None:
            return out, gu, out, None
        scale = elementwise_sigmoid(bypass_output(bypass, tap, i, gate_z, h, linear(h, layer.shared_gate)))
        return scale * out, gu, out, scale

    def input_norm(self, x: torch.Tensor, weight: torch.Tensor | None, tap: Tap | None, name: str) -> torch.Tensor:
        """``x`` RMS-normalised by ``weight`` (the attention's or the MLP's input norm), its statistic to the tap as
        ``name``; ``x`` itself where the layer has no such norm (OLMo 2)."""
        if weight is None:
            return x
        stats = rms_norm_stats(x, self.cfg.rms_norm_eps)
        if tap is not None:
            tap(name, stats[1])
        return rms_norm(x, weight, self.cfg.rms_norm_eps, stats)

    def head_norm(self, x: torch.Tensor, weight: torch.Tensor, tap: Tap | None, which: str = "qk") -> torch.Tensor:
        """Qwen3's RMSNorm of each head of ``x`` ``[T, heads, D]`` (``weight`` ``[heads, D]``): q's heads, k's, or
        both side by side (``which``); a tap sees the input and statistic of q and of k (``q_pre``, ``q_rms``,
        ``k_pre``, ``k_rms``: the norms' backward reads them)."""
        stats = rms_norm_stats(x, self.cfg.rms_norm_eps)
        if tap is not None:
            names = ("q", "k") if which == "qk" else (which,)
            sizes = [self.cfg.num_heads, self.cfg.num_kv_heads] if which == "qk" else [x.shape[1]]
            for name, pre, rms in zip(names, x.split(sizes, dim=1), stats[1].split(sizes, dim=1)):
                tap(f"{name}_pre", pre)
                tap(f"{name}_rms", rms)
        return rms_norm(x, weight, self.cfg.rms_norm_eps, stats)


# Sees a layer's intermediate tensors by name, e.g. to keep them for a backward pass.
Tap = Callable[[str, torch.Tensor], None]


def bypass_output(bypass: Bypass | None, tap: Tap | None, layer: int, module: str, x: torch.Tensor,
                   y: torch.Tensor) -> torch.Tensor:
    """``y`` through the bypass of ``module`` (if any); with a tap, the bypass's kept tensor goes to it."""
    if bypass is None or module not in bypass.modules:
        return y
    if tap is None:
        return bypass.output(layer, module, x, y)
    y, kept = bypass.output_keep(layer, module, x, y)
    if kept is not None:
        tap(module, kept)
    return y


def _renamed(tap: Tap, name: str, to: str) -> Tap:
    """``tap`` seeing ``name`` as ``to``."""
    return lambda n, value: tap(to if n == name else n, value)


def bypassed_linear(bypass: Bypass | None, tap: Tap | None, layer: int, module: str, x: torch.Tensor,
                    weight: torch.Tensor, linear: Callable[..., torch.Tensor] = F.linear,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """A frozen module's output (its ``bias`` included: gpt-oss's output projection) through the bypass of it."""
    if bypass is None or module not in bypass.modules:
        return linear(x, weight, bias)
    x = bypass.input(layer, module, x)
    return bypass_output(bypass, tap, layer, module, x, linear(x, weight, bias))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as HF's LlamaRMSNorm does; ``stats``: ``rms_norm_stats(x, eps)``
    where the caller keeps them for the backward. A float32 ``weight`` over other rows is Gemma's (``1 + w``),
    applied before the cast, as HF's Gemma3RMSNorm applies it (in float32 models the two orders are the same)."""
    xf, rstd = stats if stats is not None else rms_norm_stats(x, eps)
    if weight.dtype != x.dtype:
        return (xf * rstd * weight).to(x.dtype)
    return weight * (xf * rstd).to(x.dtype)
