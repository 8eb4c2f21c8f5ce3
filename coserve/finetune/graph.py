"""A symbolic dataflow graph of one Llama-family decoder layer with its bypass networks (FlexLLM §5.2).

Pure Python (no torch): tensors are names with a size in elements PER TOKEN, ops are
nodes with a kind and a recompute cost. ``graph_pruning`` differentiates, prunes and
plans over it. The op sequence is ``DecoderModel.layer_forward``'s, one op per step:

    attn_norm  x -> h_attn, rms_attn            q/k/v_proj  h_attn -> q_pre, k_pre, v   (+ bypass each)
    rope_q/k   q_pre -> q, k_pre -> k (K cache)  attention  q, k, v -> attn.o, attn.lse  (v: V cache)
    o_proj     attn.o -> attn_proj (+ bypass)   attn_residual  x + attn_proj -> resid
    mlp_norm   resid -> h_mlp, rms_mlp          gate/up_proj  h_mlp -> gate, up          (+ bypass each)
    silu       gate -> act                       gate_mul  act * up -> mlp_in
    down_proj  mlp_in -> mlp_out (+ bypass)      mlp_residual  resid + mlp_out -> out

A mixture of experts (``LayerShape.experts_per_token``) replaces the MLP after ``mlp_norm``:

    gate (router)  h_mlp -> moe.logits (+ bypass)   moe.softmax  moe.logits -> moe.probs (float32)
    experts.gate_up_proj  h_mlp -> moe.gu (every expert of a token's, + bypass)
    moe.act_mul  moe.gu -> moe.mlp_in           experts.down_proj  moe.mlp_in -> moe.y (+ bypass)
    moe.route  moe.y, moe.probs -> mlp_out      (Qwen2-MoE: + each adapted shared-expert module's output)

A bypassed module's frozen matmul writes ``<module>.y`` and the bypass writes the name
downstream ops read, so base tensors keep their names whatever the PEFT config.

Cost model (``Op.flops``: FLOPs per token, forward): a matmul with an ``in x out`` weight
costs ``2*in*out``; elementwise multiply / scale / add 1 per output element; SiLU 4 and
ReLU 1 per element; RMSNorm 4 per element (square, sum, scale, weight); RoPE 3 per element
(two multiplies, one add); attention ``4*q_size*context`` (QK^T and PV over
``LayerShape.context_tokens`` keys) plus 5 per score for the softmax. ``Op.flops_per_element``
divides by the elements the op writes per token: the recompute time per byte it saves,
which is what the rematerialisation threshold compares. A norm's per-row statistic alone
costs a square and a sum per input element for its one element (``Op.recompute_flops_per_element``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from coserve.model.linear_modules import (ALL_LINEAR, ALL_TARGET_MODULES, EXPERT_MODULES, ROUTER,
                                          SHARED_EXPERT_MODULES, TARGET_MODULES, ordered, shared_expert_shapes,
                                          split_fused)
from coserve.model.rank_pattern import module_ranks


FLOPS_PER_ELEMENT = {"mul": 1, "scale": 1, "add": 1, "silu": 4, "relu": 1, "norm": 4, "rope": 3}
SOFTMAX_FLOPS_PER_SCORE = 5


class TensorKind(str, Enum):
    ACTIVATION = "activation"  # per-token data produced in the forward pass (or the layer input)
    WEIGHT = "weight"  # a parameter: resident anyway, never counted in the keep set
    INDEX = "index"  # integer metadata (position ids): resident, never differentiated


class OpKind(str, Enum):
    MATMUL_FROZEN = "matmul_frozen"  # x @ W^T (+ b) with a frozen W
    MATMUL_TRAINABLE = "matmul_trainable"  # x @ W^T with a trainable W (LoRA A, B)
    ELEMENTWISE = "elementwise"  # fn "mul" (two operands) or "scale" (by a constant)
    NORM = "norm"  # RMSNorm: outputs (normalised, per-row rms statistic)
    ROPE = "rope"  # rotary embedding by position id
    ATTENTION = "attention"  # causal attention: outputs (o, logsumexp per head)
    ADD = "add"
    ACTIVATION = "activation"  # fn "silu" or "relu"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One symbolic tensor."""

    name: str
    kind: TensorKind
    elements: int  # per token for activations; 0 for weights and indices
    trainable: bool = False  # weights only
    producer: str | None = None  # the op that writes it; None for inputs, weights, indices
    element_size: int = 0  # bytes per element when not the graph's (attention's log-sum-exp is float32)


@dataclass(frozen=True, slots=True)
class Op:
    """One forward operator; ``inputs`` are ordered as its backward rule expects them."""

    name: str
    kind: OpKind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]  # outputs[0] is differentiable; the rest are statistics (rms, lse)
    flops: float  # forward FLOPs per token
    fn: str = ""  # elementwise / activation function
    output_elements: int = 1  # elements written per token, all outputs together

    @property
    def flops_per_element(self) -> float:
        """Recompute FLOPs per element it writes (the rematerialisation cost)."""
        return self.flops / max(self.output_elements, 1)

    def recompute_flops_per_element(self, tensor: str, input_elements: int) -> float:
        """What recomputing ``tensor`` (one of ``outputs``) costs per element it holds: the op's average, except
        for a norm's per-row statistic, a reduction over the ``input_elements`` of its row (a square and a sum
        each) for one element, so that keeping it (4 bytes a token) spares the backward that reduction."""
        if self.kind is OpKind.NORM and tensor != self.outputs[0]:
            return 2.0 * input_elements
        return self.flops_per_element


@dataclass(slots=True)
class LayerGraph:
    """Ops in forward (topological) order over named tensors."""

    tensors: dict[str, TensorSpec]
    ops: list[Op]
    input: str  # the layer input: always kept (every recomputation starts from it)
    output: str  # the layer output (the next layer's input: not counted in this layer)
    always_kept: tuple[str, ...]  # stored whatever the plan: the input and the K/V cache
    required_grads: tuple[str, ...]  # gradients that must be produced (see graph_pruning)
    element_size: int  # bytes per element
    title: str = ""
    projections: tuple[str, ...] = ()  # costly tensors (matmul, attention outputs) pass (b) may recompute

    def op(self, name: str) -> Op:
        return next(o for o in self.ops if o.name == name)

    def producer(self, tensor: str) -> Op | None:
        p = self.tensors[tensor].producer
        return None if p is None else self.op(p)

    def activations(self) -> list[str]:
        return [t.name for t in self.tensors.values() if t.kind is TensorKind.ACTIVATION]


class GraphBuilder:
    """Builds a ``LayerGraph`` op by op; also for hand-built graphs in tests."""

    def __init__(self, element_size: int) -> None:
        self.element_size = element_size
        self.tensors: dict[str, TensorSpec] = {}
        self.ops: list[Op] = []

    def _add(self, spec: TensorSpec) -> str:
        if spec.name in self.tensors:
            raise ValueError(f"tensor {spec.name!r} is defined twice")
        self.tensors[spec.name] = spec
        return spec.name

    def input(self, name: str, elements: int) -> str:
        return self._add(TensorSpec(name, TensorKind.ACTIVATION, elements))

    def weight(self, name: str, trainable: bool = False) -> str:
        return self._add(TensorSpec(name, TensorKind.WEIGHT, 0, trainable=trainable))

    def set_element_size(self, name: str, element_size: int) -> None:
        """Store ``name`` at ``element_size`` bytes per element whatever the graph's (e.g. float32 statistics)."""
        spec = self.tensors[name]
        self.tensors[name] = TensorSpec(spec.name, spec.kind, spec.elements, spec.trainable, spec.producer,
                                        element_size)

    def index(self, name: str) -> str:
        return self._add(TensorSpec(name, TensorKind.INDEX, 0))

    def op(self, name: str, kind: OpKind, inputs: tuple[str, ...], outputs: tuple[tuple[str, int], ...],
           flops: float, fn: str = "") -> str:
        """Add an op writing ``outputs`` (name, elements per token); returns the first output's name."""
        for t in inputs:
            if t not in self.tensors:
                raise ValueError(f"op {name!r}: input {t!r} is not defined yet")
        for out, n in outputs:
            self._add(TensorSpec(out, TensorKind.ACTIVATION, n, producer=name))
        self.ops.append(Op(name, kind, inputs, tuple(o for o, _ in outputs), flops, fn,
                           sum(n for _, n in outputs)))
        return outputs[0][0]

    def matmul(self, name: str, x: str, in_features: int, out_features: int, out: str,
               trainable: bool = False, bias: bool = False) -> str:
        """``out = x @ W^T (+ b)``: ``[in] -> [out]`` per token, weight ``<name>.W``."""
        ins = (x, self.weight(f"{name}.W", trainable)) + ((self.weight(f"{name}.b"),) if bias else ())
        kind = OpKind.MATMUL_TRAINABLE if trainable else OpKind.MATMUL_FROZEN
        return self.op(name, kind, ins, ((out, out_features),), 2 * in_features * out_features)

    def pointwise(self, name: str, kind: OpKind, fn: str, inputs: tuple[str, ...], out: str) -> str:
        """An elementwise op of ``fn`` (mul, scale, add, silu, relu) with its output as big as inputs[0]."""
        n = self.tensors[inputs[0]].elements
        return self.op(name, kind, inputs, ((out, n),), FLOPS_PER_ELEMENT[fn] * n, fn)

    def norm(self, name: str, x: str, out: str, rms: str, groups: int = 1) -> str:
        """RMSNorm: ``out`` and the per-row statistic ``rms`` (``rsqrt(mean(x^2) + eps)``, float32 whatever the
        graph's element size, as the executors compute it); with ``groups``, over each of that many equal parts of
        a row (Qwen3's norm of each head), one statistic each."""
        n = self.tensors[x].elements
        first = self.op(name, OpKind.NORM, (x, self.weight(f"{name}.w")), ((out, n), (rms, groups)),
                        FLOPS_PER_ELEMENT["norm"] * n)
        self.set_element_size(rms, 4)
        return first

    def build(self, input: str, output: str, always_kept: tuple[str, ...], required_grads: tuple[str, ...],
              title: str = "", projections: tuple[str, ...] = ()) -> LayerGraph:
        return LayerGraph(dict(self.tensors), list(self.ops), input, output, always_kept, required_grads,
                          self.element_size, title, projections)


@dataclass(slots=True)
class LayerShape:
    """What the graph needs of a model's shape (``from_model_config`` reads a ``ModelConfig``)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: q and k RMS-normalised per head before the rotation
    element_size: int = 2  # bytes per element: 2 for bf16/fp16, 4 for fp32
    context_tokens: int = 512  # keys attended per token on average (half a causal sequence); prices attention
    # a mixture of experts: its experts and how many each token runs through (0: a dense MLP); intermediate_size is
    # then one expert's
    num_experts: int = 0
    experts_per_token: int = 0
    shared_expert_size: int = 0  # Qwen2-MoE's shared expert's intermediate size (0: none)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                     "element_size", "context_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LayerShape.{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LayerShape.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_model_config(cls, cfg: Any, element_size: int, context_tokens: int = 512) -> "LayerShape":
        """From a ``coserve.model.config.ModelConfig`` (or anything with its field names)."""
        moe = bool(getattr(cfg, "moe", False))
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   bool(cfg.qkv_bias), bool(getattr(cfg, "qk_norm", False)), element_size, context_tokens,
                   cfg.num_experts if moe else 0, cfg.experts_per_token if moe else 0,
                   (getattr(cfg, "shared_expert_size", 0) or 0) if moe else 0)

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` per target module, as ``DecoderModel.module_shapes``."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        if self.experts_per_token:  # the router; every token's experts together (EXPERT_MODULES)
            k = self.experts_per_token
            shared = shared_expert_shapes(h, self.shared_expert_size)
            return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                    ROUTER: (h, self.num_experts), EXPERT_MODULES[0]: (h, 2 * k * i), EXPERT_MODULES[1]: (k * i, h),
                    **shared}
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def peft_summary(peft: Any) -> str:
    """A one-line name of a PEFT config, e.g. ``LoRA r=16 on down_proj``."""
    mods = ", ".join(ordered(peft.target_modules) + list(getattr(peft, "target_parameters", None) or [])) or ALL_LINEAR
    if peft.peft_type == "LORA":
        return f"{'DoRA' if getattr(peft, 'use_dora', False) else 'LoRA'} r={peft.r} on {mods}"
    ff = ordered(peft.feedforward_modules)
    return f"IA3 on {mods}" + (f" (input-scaled: {', '.join(ff)})" if ff else "")


def _check_peft(peft: Any) -> None:
    kind = getattr(peft, "peft_type", None)
    if kind not in ("LORA", "IA3"):
        raise ValueError(f"peft_config.peft_type: must be 'LORA' or 'IA3', got {kind!r}")
    unknown = sorted(set(peft.target_modules) - set(ALL_TARGET_MODULES) - {ALL_LINEAR})
    if unknown or not (peft.target_modules or getattr(peft, "target_parameters", None)):
        raise ValueError(f"peft_config.target_modules: {list(peft.target_modules)!r} must be a non-empty "
                         f"subset of {', '.join(ALL_TARGET_MODULES)}")
    if kind == "LORA" and (not isinstance(peft.r, int) or peft.r <= 0):
        raise ValueError(f"peft_config.r: must be a positive integer, got {peft.r!r}")


def build_layer_graph(shape: LayerShape, peft: Any, attention_backward: str = "flash") -> LayerGraph:
    """The graph of one decoder layer with ``peft``'s bypass networks.

    ``attention_backward``: "flash" (the backward reads q, k, v, the output and the float32
    log-sum-exp: what coserve's pruned executor does where ``window_attention`` has a kept-output
    backward) or "recompute" (it recomputes attention from q, k, v, as the executor does
    elsewhere: then the output costs nothing extra to rematerialise and lse is not read).

    ``peft`` is a ``coserve.peft.config.LoraConfig`` or ``IA3Config``, or any object with
    ``peft_type`` ("LORA" / "IA3"), ``target_modules``, and ``r`` (LoRA) or
    ``feedforward_modules`` (IA3, the input-scaled modules); duck-typed so that this
    module stays torch-free.
    """
    _check_peft(peft)
    b = GraphBuilder(shape.element_size)
    dims = shape.module_shapes()
    # all-linear as a Llama-family model's; a fused module (Phi-3's qkv_proj, gate_up_proj) priced as its parts: its
    # bypass keeps as much (an IA3 output as wide, a LoRA x A^T per part: r values a token more than one) and reads
    # the same input
    targets = set(TARGET_MODULES if list(peft.target_modules) == [ALL_LINEAR] else split_fused(peft.target_modules))
    targets |= set(getattr(peft, "target_parameters", None) or ())  # a mixture's experts
    input_scaled = set(getattr(peft, "feedforward_modules", ())) if peft.peft_type == "IA3" else set()
    ranks = {}
    if peft.peft_type == "LORA":  # each module's (PEFT's rank_pattern); the experts' over every expert of a token
        ranks = module_ranks(peft.r, peft.lora_alpha, bool(getattr(peft, "use_rslora", False)),
                             getattr(peft, "rank_pattern", None) or {}, getattr(peft, "alpha_pattern", None) or {},
                             sorted(targets & set(dims)), 1)
        ranks.update({m: ranks[m] * shape.experts_per_token for m in EXPERT_MODULES if m in ranks})

    def linear(module: str, x: str, out: str, bias: bool = False) -> str:
        """Frozen ``module`` on ``x`` plus its bypass; writes ``out`` (the name consumers read)."""
        fan_in, fan_out = dims[module]
        if module not in targets:
            return b.matmul(module, x, fan_in, fan_out, out, bias=bias)
        if module in input_scaled:  # IA3 feed-forward: scale the input, then the frozen matmul
            l_in = b.weight(f"{module}.ia3_l", trainable=True)
            scaled = b.op(f"{module}.ia3", OpKind.ELEMENTWISE, (x, l_in), ((f"{module}.in", fan_in),),
                          fan_in, "mul")
            return b.matmul(module, scaled, fan_in, fan_out, out, bias=bias)
        y = b.matmul(module, x, fan_in, fan_out, f"{module}.y", bias=bias)
        if peft.peft_type == "IA3":  # scale the output
            l_out = b.weight(f"{module}.ia3_l", trainable=True)
            return b.op(f"{module}.ia3", OpKind.ELEMENTWISE, (y, l_out), ((out, fan_out),), fan_out, "mul")
        r = ranks.get(module, peft.r)
        xa = b.matmul(f"{module}.lora_A", x, fan_in, r, f"{module}.lora_a", trainable=True)  # [r]
        xab = b.matmul(f"{module}.lora_B", xa, r, fan_out, f"{module}.lora_b", trainable=True)  # [out]
        scaled = b.pointwise(f"{module}.lora_scale", OpKind.ELEMENTWISE, "scale", (xab,), f"{module}.lora_s")
        if not getattr(peft, "use_dora", False):
            return b.pointwise(f"{module}.lora_add", OpKind.ADD, "add", (y, scaled), out)
        # DoRA: the sum times m / ||W + scaling B A|| (the norm detached: a constant of the step), so dm reads it
        total = b.pointwise(f"{module}.lora_add", OpKind.ADD, "add", (y, scaled), f"{module}.lora_sum")
        magnitude = b.weight(f"{module}.lora_magnitude", trainable=True)
        return b.op(f"{module}.dora", OpKind.ELEMENTWISE, (total, magnitude), ((out, fan_out),), fan_out, "mul")

    x = b.input("x", shape.hidden_size)  # [H]
    pos = b.index("positions")
    h = b.norm("attn_norm", x, "h_attn", "rms_attn")  # [H], [1]
    q_pre = linear("q_proj", h, "q_pre", shape.qkv_bias)  # [Hq*D]
    k_pre = linear("k_proj", h, "k_pre", shape.qkv_bias)  # [Hkv*D]
    v = linear("v_proj", h, "v", shape.qkv_bias)  # [Hkv*D]: the V cache
    q_in, k_in = q_pre, k_pre  # what the rotation reads
    if shape.qk_norm:  # Qwen3: each head normalised; the backward reads the input and the per-head statistic
        q_in = b.norm("q_norm", q_pre, "q_normed", "q_rms", groups=shape.num_heads)
        k_in = b.norm("k_norm", k_pre, "k_normed", "k_rms", groups=shape.num_kv_heads)
    rope = FLOPS_PER_ELEMENT["rope"]
    q = b.op("rope_q", OpKind.ROPE, (q_in, pos), (("q", shape.q_size),), rope * shape.q_size)
    k = b.op("rope_k", OpKind.ROPE, (k_in, pos), (("k", shape.kv_size),), rope * shape.kv_size)  # K cache
    if attention_backward not in ("flash", "recompute"):
        raise ValueError(f"attention_backward: must be 'flash' or 'recompute', got {attention_backward!r}")
    attn_flops = (4 * shape.q_size + SOFTMAX_FLOPS_PER_SCORE * shape.num_heads) * shape.context_tokens
    if attention_backward == "recompute":
        attn_flops = 0.0  # the backward recomputes attention anyway: its output comes for free
    o = b.op("attention", OpKind.ATTENTION, (q, k, v),
             (("attn.o", shape.q_size), ("attn.lse", shape.num_heads)), attn_flops,
             fn=attention_backward)  # [Hq*D], [Hq]
    b.set_element_size("attn.lse", 4)
    proj = linear("o_proj", o, "attn_proj")  # [H]
    resid = b.pointwise("attn_residual", OpKind.ADD, "add", (x, proj), "resid")  # [H]
    h2 = b.norm("mlp_norm", resid, "h_mlp", "rms_mlp")  # [H], [1]
    if shape.experts_per_token:
        mlp_out, projections = _mixture(b, shape, linear, h2, targets)
    else:
        gate = linear("gate_proj", h2, "gate")  # [I]
        up = linear("up_proj", h2, "up")  # [I]
        act = b.pointwise("silu", OpKind.ACTIVATION, "silu", (gate,), "act")  # [I]
        mlp_in = b.pointwise("gate_mul", OpKind.ELEMENTWISE, "mul", (act, up), "mlp_in")  # [I]
        mlp_out = linear("down_proj", mlp_in, "mlp_out")  # [H]
        projections = (gate, up)
    out = b.pointwise("mlp_residual", OpKind.ADD, "add", (resid, mlp_out), "out")  # [H]
    title = (f"{peft_summary(peft)}; hidden {shape.hidden_size}, intermediate {shape.intermediate_size}, "
             f"heads {shape.num_heads}/{shape.num_kv_heads} x {shape.head_dim}"
             f"{' (q/k norms)' if shape.qk_norm else ''}, {shape.element_size} B/element")
    # dL/dK and dL/dV are required: later tokens' backward windows produce them for earlier tokens.
    # What the pruned executor can recompute in its backward instead of storing (bypass tensors stay
    # kept): the projections (with q/k norms, also their inputs), and attention's output (with its lse) when the
    # backward reads them.
    pre = (q_pre, k_pre) if shape.qk_norm else ()
    return b.build(x, out, always_kept=(x, k, v), required_grads=(x, k, v), title=title,
                   projections=(*pre, q, o, resid, *projections) if attention_backward == "flash"
                   else (*pre, q, resid, *projections))


def _mixture(b: GraphBuilder, shape: LayerShape, linear, h: str, targets: set[str]) -> tuple[str, tuple[str, ...]]:
    """A mixture of experts over the MLP's input ``h``, as ``moe.moe_mlp`` and its pruned backward
    (``moe_backward.py``) run it; returns its output and what may be recomputed. The router's float32 probabilities
    ``moe.probs`` (kept: the backward routes by them, and nothing it keeps recomputes them); each token's experts'
    gate/up outputs together, ``moe.gu`` (``k * 2I``: kept or recomputed from ``h``), the product of their activation
    (``k * I``), the down projections summed into ``[H]``, and the routing weights' product: its gradient to the
    output reads the probabilities, the one to the probabilities reads the product (``<dy @ down_e, m>``), not the
    experts' outputs. The router and each expert parameter take their bypass (``linear``: a LoRA of the experts has
    ``k`` times the rank, one per expert a token runs through); Qwen2-MoE's shared expert's adapters' own tensors
    (``_shared_expert_bypasses``: the executor keeps nothing else of it)."""
    k, e, i = shape.experts_per_token, shape.num_experts, shape.intermediate_size
    logits = linear(ROUTER, h, "moe.logits")  # [E]
    probs = b.op("moe.softmax", OpKind.ACTIVATION, (logits,), (("moe.probs", e),), SOFTMAX_FLOPS_PER_SCORE * e,
                 "softmax")
    b.set_element_size(probs, 4)
    gu = linear(EXPERT_MODULES[0], h, "moe.gu")  # [k * 2I]
    mlp_in = b.op("moe.act_mul", OpKind.ELEMENTWISE, (gu, gu), (("moe.mlp_in", k * i),),
                  (FLOPS_PER_ELEMENT["silu"] + FLOPS_PER_ELEMENT["mul"]) * k * i, "mul")  # act(gate) * up
    y = linear(EXPERT_MODULES[1], mlp_in, "moe.y")  # [H]: every expert's down projection, summed
    shared = [m for m in SHARED_EXPERT_MODULES if m in targets] if shape.shared_expert_size else []
    out = b.op("moe.route", OpKind.ELEMENTWISE, (y, probs, mlp_in), (("moe.out" if shared else "mlp_out",
                                                                     shape.hidden_size),), k * shape.hidden_size,
               "route")
    return (_shared_expert_bypasses(b, shape, linear, h, out, shared) if shared else out), (gu,)


def _shared_expert_bypasses(b: GraphBuilder, shape: LayerShape, linear, h: str, out: str, adapted: list[str]) -> str:
    """Qwen2-MoE's shared expert, as its pruned backward runs it: recomputed whole from the MLP's input, so only its
    ``adapted`` modules' own tensors are kept (LoRA's ``x A^T``, IA3's frozen output, DoRA's unscaled one). Each is
    priced as its frozen matmul and bypass from ``h`` (the down projection's from a product recomputed from ``h``),
    its output added to the mixture's ``out``; returns the sum, ``mlp_out``."""
    outputs = [out]
    for module in adapted:
        x = h
        if module == SHARED_EXPERT_MODULES[2]:  # the down projection reads act(gate) * up, recomputed from h
            x = b.op("shared.act_mul", OpKind.ELEMENTWISE, (h, h), (("shared.mlp_in", shape.shared_expert_size),),
                     (FLOPS_PER_ELEMENT["silu"] + FLOPS_PER_ELEMENT["mul"]) * shape.shared_expert_size, "mul")
        outputs.append(linear(module, x, f"shared.{module}"))
    return b.op("shared.sum", OpKind.ADD, tuple(outputs), (("mlp_out", shape.hidden_size),), len(outputs) - 1)
