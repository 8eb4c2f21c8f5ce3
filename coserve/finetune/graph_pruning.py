"""Graph pruning (FlexLLM §5.2, Algorithm 1): which activations a PEFT backward needs, per token.

Pure Python over ``coserve.finetune.graph``. Steps:

1. Reverse-mode differentiation: every op yields one ``BackwardStep`` per differentiable input
   (activations and weights), each naming the FORWARD tensors it reads (``_rule``).
2. Pruning: steps computing frozen weights' gradients are removed; then, to a fixed point,
   any step whose gradient no surviving step reads is removed. A gradient is needed when it
   is a trainable weight's, or the producer of its tensor has a surviving step, or it is
   required: dL/dx (the layer input) because earlier layers' bypasses need it, and dL/dK,
   dL/dV because later tokens' backward windows produce them for earlier tokens' K/V (the
   accumulator fed to this layer's backward on those tokens). With ``need_input_grad=False``
   (e.g. layer 0, whose input is the frozen embedding) nothing is required: K/V gradients
   are then needed exactly when the steps that consume them inside the layer survive,
   since earlier windows run those same steps.
3. The activations read by the surviving steps form the keep set; the layer input and
   the K/V cache are always stored.
4. Rematerialisation (policy ``cheap``), in two passes. (a) A kept tensor whose recomputation
   costs under ``cost_threshold`` FLOPs per element it holds (``Op.recompute_flops_per_element``:
   a norm's output is cheap, its per-row statistic a reduction over the row, so it stays stored)
   and whose producer's activation inputs are all in the keep set (stored, or themselves
   rematerialised: they are recomputed first) is recomputed in the backward pass instead of
   stored. (b) Then, if the layer still keeps more than ``memory_target`` times the bytes of the
   pruned keep set (what step 3 stores, i.e. what a pruned autograd would save), the costly
   tensors (``LayerGraph.projections``: rotated q, attention's output with its log-sum-exp, the
   residual after attention, gate, up) are recomputed instead, with whatever chain of ops leads to
   them from available tensors: of every subset of them that meets the target, the one costing
   least (``_meet_target``; when none does, the one keeping the fewest bytes). Its cost is its
   FLOPs plus ``op_flops`` for each operation the executor dispatches to recompute it
   (``RECOMPUTE_DISPATCHES``): what the host's time to launch one is worth in FLOPs, per token
   (the executors pass the device's charge per window divided by the sequence's tokens; 0 prices
   FLOPs alone). Attention's FLOPs grow with the context (``LayerShape.context_tokens``), so long
   sequences recompute projections and keep attention's output; short ones recompute attention
   where FLOPs decide, but a projection (fewer operations) where launching them is what costs.
   ``all`` stores only the input and K/V and recomputes the rest (what
   ``coserve.finetune.token_windows`` does); ``none`` stores the whole keep set.
5. Bitmask compression: a stored tensor that every surviving reader needs only the sign of
   (ReLU's backward) is kept as 1 bit per element. A recomputation reads its inputs in full,
   so rematerialising from a bitmask-only tensor is taken only when it saves bytes overall.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from coserve.finetune.graph import LayerGraph, LayerShape, Op, OpKind, TensorKind, build_layer_graph

POLICIES = ("cheap", "all", "none")
DEFAULT_COST_THRESHOLD = 8.0  # FLOPs per output element: elementwise, norms, RoPE, SiLU are under it
# Pass (b) recomputes costly tensors until the layer keeps at most this fraction of the pruned keep
# set's bytes (on Llama shapes at 1,024 tokens: the gate projection for LoRA on down_proj; q and the
# post-attention residual for LoRA on every linear module).
DEFAULT_MEMORY_TARGET = 0.5
# The operations the pruned executor (``coserve.finetune.pruned_layer``) dispatches to recompute one op of each kind
# in a backward window: a norm's two (its statistic is kept: the scale and the weight), the projection and its
# reshape, the rotation's four; attention recomputed from q, K and V runs its forward under autograd and its backward
# through autograd (some 25 operations, where its kept output's backward takes one call).
RECOMPUTE_DISPATCHES = {OpKind.MATMUL_FROZEN: 2, OpKind.MATMUL_TRAINABLE: 2, OpKind.ELEMENTWISE: 1, OpKind.NORM: 2,
                        OpKind.ROPE: 4, OpKind.ATTENTION: 25, OpKind.ADD: 1, OpKind.ACTIVATION: 1}


@dataclass(frozen=True, slots=True)
class Read:
    """A forward tensor a backward step reads; ``sign_only``: just whether each element is > 0."""

    tensor: str
    sign_only: bool = False


@dataclass(frozen=True, slots=True)
class BackwardStep:
    """dL/d(op.inputs[slot]) from dL/d(op's output): one gradient computation of the backward graph."""

    op: str
    slot: int
    wrt: str  # the input tensor whose gradient (contribution) it computes
    reads: tuple[Read, ...]  # forward tensors it reads, besides the incoming gradient

    @property
    def key(self) -> tuple[str, int]:
        """Stable across PEFT configs (a bypass renames tensors, never ops or slots)."""
        return (self.op, self.slot)

    @property
    def name(self) -> str:
        return f"{self.op}: d({self.wrt})"


def _rule(op: Op) -> list[tuple[int, tuple[Read, ...]]]:
    """(input slot, forward reads) of each gradient ``op`` yields, before pruning."""
    ins, outs = op.inputs, op.outputs
    r = lambda *names: tuple(Read(n) for n in names)  # noqa: E731
    if op.kind in (OpKind.MATMUL_FROZEN, OpKind.MATMUL_TRAINABLE):
        # y = x W^T + b: dx = dy W reads W; dW = dy^T x reads x; db = sum(dy) reads nothing.
        return [(0, r(ins[1])), (1, r(ins[0]))] + ([(2, ())] if len(ins) > 2 else [])
    if op.kind is OpKind.ELEMENTWISE and op.fn == "mul":  # d(a*b): da reads b, db reads a
        return [(0, r(ins[1])), (1, r(ins[0]))]
    if op.kind is OpKind.ELEMENTWISE and op.fn == "scale":  # by a constant
        return [(0, ())]
    if op.kind is OpKind.ELEMENTWISE and op.fn == "route":  # a mixture's sum of its experts' outputs y_e weighted by
        # the probabilities p (ins[1]): d(y) reads p; d(p) reads the experts' activation product (ins[2], <dy W, m>)
        return [(0, r(ins[1])), (1, r(ins[2]))]
    if op.kind is OpKind.ACTIVATION and op.fn == "softmax":  # softmax'(x) needs its output
        return [(0, r(outs[0]))]
    if op.kind is OpKind.ADD:
        return [(i, ()) for i in range(len(ins))]
    if op.kind is OpKind.ACTIVATION and op.fn == "silu":  # silu'(x) needs x
        return [(0, r(ins[0]))]
    if op.kind is OpKind.ACTIVATION and op.fn == "relu":  # relu'(x) needs only x > 0
        return [(0, (Read(ins[0], sign_only=True),))]
    if op.kind is OpKind.NORM:  # y = w * x / rms: dx reads x, rms, w; dw reads x, rms
        return [(0, r(ins[0], outs[1], ins[1])), (1, r(ins[0], outs[1]))]
    if op.kind is OpKind.ROPE:  # a rotation by position: the transpose rotation, no activation
        return [(0, r(ins[1]))]
    if op.kind is OpKind.ATTENTION:
        # Flash-attention backward: P = exp(q k^T - lse) needs q, k, lse; dV = P^T dO needs no more;
        # dq and dk also need dP = dO V^T (v) and rowsum(dO * o) (o).
        q, k, v = ins
        if op.fn == "recompute":  # P and o are recomputed from q, k, v inside the backward
            return [(0, r(q, k, v)), (1, r(q, k, v)), (2, r(q, k, v))]
        full = r(q, k, v, outs[0], outs[1])
        return [(0, full), (1, full), (2, r(q, k, outs[1]))]
    raise ValueError(f"op {op.name!r}: no backward rule for kind {op.kind.value} fn {op.fn!r}")


def differentiate(graph: LayerGraph) -> list[BackwardStep]:
    """The backward graph: every gradient computation of every op, in reverse forward order."""
    steps = []
    for op in reversed(graph.ops):
        for slot, reads in _rule(op):
            if graph.tensors[op.inputs[slot]].kind is not TensorKind.INDEX:
                steps.append(BackwardStep(op.name, slot, op.inputs[slot], reads))
    return steps


def prune(graph: LayerGraph, steps: list[BackwardStep], need_input_grad: bool = True
          ) -> tuple[list[BackwardStep], list[BackwardStep]]:
    """Algorithm 1, step 1: ``(surviving, pruned)`` steps, each in backward order."""
    sinks = set(graph.required_grads) if need_input_grad else set()
    alive = {s.key: s for s in steps
             if not (graph.tensors[s.wrt].kind is TensorKind.WEIGHT and not graph.tensors[s.wrt].trainable)}
    changed = True
    while changed:  # drop steps whose gradient nobody reads, until none is dropped
        live_ops = {s.op for s in alive.values()}
        dead = [k for k, s in alive.items() if not _needed(graph, s.wrt, sinks, live_ops)]
        for k in dead:
            del alive[k]
        changed = bool(dead)
    return [s for s in steps if s.key in alive], [s for s in steps if s.key not in alive]


def _needed(graph: LayerGraph, tensor: str, sinks: set[str], live_ops: set[str]) -> bool:
    spec = graph.tensors[tensor]
    return spec.trainable or tensor in sinks or (spec.producer is not None and spec.producer in live_ops)


def keep_set(graph: LayerGraph, surviving: list[BackwardStep]) -> dict[str, bool]:
    """Activations the surviving steps read -> whether every such read needs only the sign."""
    keep: dict[str, bool] = {}
    for s in surviving:
        for rd in s.reads:
            if graph.tensors[rd.tensor].kind is TensorKind.ACTIVATION:
                keep[rd.tensor] = keep.get(rd.tensor, True) and rd.sign_only
    return keep


def training_flops(graph: LayerGraph, surviving: list[BackwardStep]) -> float:
    """FLOPs per token of one layer's forward and pruned backward (what the plan reports its recompute FLOPs against).

    Each surviving backward step is priced at its op's forward FLOPs (a matmul's input or
    weight gradient costs what the forward matmul does).
    """
    ops = {op.name: op for op in graph.ops}
    return sum(op.flops for op in graph.ops) + sum(ops[s.op].flops for s in surviving)


def rematerialize(graph: LayerGraph, keep: dict[str, bool], policy: str, cost_threshold: float,
                  target_bytes: float | None = None, op_flops: float = 0.0) -> tuple[dict[str, str], list[str]]:
    """Algorithm 1, step 2: ``(stored name -> "full" | "bitmask", rematerialised names in forward order)``.

    ``target_bytes``: per token, what pass (b) brings the stored bytes down to (None: no pass (b));
    ``op_flops``: pass (b)'s charge per operation a recomputation dispatches, besides its FLOPs.
    """
    order = [t for op in graph.ops for t in op.outputs if t in keep]  # forward order
    if policy == "all":
        return {t: "full" for t in graph.always_kept}, [t for t in order if t not in graph.always_kept]
    stored = _as_stored(graph, keep)
    remat: list[str] = []
    changed = policy == "cheap"
    while changed:  # each pass may unlock or price differently what an earlier one decided
        changed = False
        for t in order:
            op = graph.producer(t)
            if (t not in stored or t in graph.always_kept
                    or op.recompute_flops_per_element(t, graph.tensors[op.inputs[0]].elements) >= cost_threshold):
                continue
            inputs = [i for i in op.inputs if graph.tensors[i].kind is TensorKind.ACTIVATION]
            if not all(i in stored or i in remat or i == graph.input for i in inputs):
                continue
            masks = [i for i in inputs if stored.get(i) == "bitmask"]
            if _bytes(graph, t, stored[t]) <= sum(_bytes(graph, i, "full") - _bytes(graph, i, "bitmask")
                                                  for i in masks):
                continue  # recomputing would need a bitmask input in full, and cost more than it saves
            for i in masks:
                stored[i] = "full"
            del stored[t]
            remat.append(t)
            changed = True
    if policy == "cheap" and target_bytes is not None:
        remat += _meet_target(graph, stored, remat, target_bytes, op_flops)
    return stored, [t for op in graph.ops for t in op.outputs if t in remat]


def _meet_target(graph: LayerGraph, stored: dict[str, str], remat: list[str], target: float,
                 op_flops: float = 0.0) -> list[str]:
    """Pass (b): recompute the subset of ``graph.projections`` costing least (its FLOPs plus ``op_flops``
    for each operation its recomputation dispatches) that brings the stored bytes to ``target`` (or,
    when no subset does, the one storing the fewest bytes).

    Returns the tensors added to the rematerialised set (the chosen tensors, the intermediates of
    their chains, and their producers' other stored outputs: recomputing attention's output
    recomputes its log-sum-exp too), removing the stored ones from ``stored``.
    """
    candidates = [t for t in graph.projections if stored.get(t) == "full" and t not in graph.always_kept]
    total = sum(_bytes(graph, t, how) for t, how in stored.items())
    best: tuple[tuple, list[str], list[str]] | None = None
    for size in range(len(candidates) + 1):
        for subset in combinations(candidates, size):
            dropped = [o for t in subset for o in graph.producer(t).outputs if stored.get(o) == "full"]
            available = ({t for t, how in stored.items() if how == "full"} - set(dropped)) | set(remat) | {graph.input}
            chains: list[str] = []
            for t in subset:
                chain = _chain(graph, t, available | set(chains))
                if chain is None:
                    break
                chains += [c for c in chain if c not in chains]
            else:
                cost = sum(graph.producer(c).flops + op_flops * RECOMPUTE_DISPATCHES[graph.producer(c).kind]
                           for c in chains)
                left = total - sum(_bytes(graph, o, "full") for o in set(dropped))
                key = (0, cost, left) if left <= target else (1, left, cost)
                if best is None or key < best[0]:
                    best = (key, dropped, chains)
    _, dropped, chains = best
    for o in set(dropped):
        del stored[o]
    return chains + [o for o in dict.fromkeys(dropped) if o not in chains]


def _chain(graph: LayerGraph, tensor: str, available: set[str]) -> list[str] | None:
    """Tensors to recompute, in forward order, to get ``tensor`` from ``available`` ones (None: impossible).

    A producer with several outputs (a norm and its rms) recomputes them all; only the first is listed.
    """
    out: list[str] = []

    def visit(t: str) -> bool:
        spec = graph.tensors[t]
        if spec.kind is not TensorKind.ACTIVATION or t in available or t in out:
            return True
        op = graph.producer(t)
        if op is None or not all(visit(i) for i in op.inputs):
            return False
        if op.outputs[0] not in out:
            out.append(op.outputs[0])
        return True

    return out if visit(tensor) else None


def _as_stored(graph: LayerGraph, keep: dict[str, bool]) -> dict[str, str]:
    """The keep set as stored with nothing rematerialised: sign-only tensors as bitmasks, the rest in full."""
    stored = {t: "bitmask" if sign and t not in graph.always_kept else "full" for t, sign in keep.items()}
    stored.update({t: "full" for t in graph.always_kept})
    return stored


def _bytes(graph: LayerGraph, tensor: str, storage: str) -> float:
    spec = graph.tensors[tensor]
    return spec.elements / 8 if storage == "bitmask" else spec.elements * (spec.element_size or graph.element_size)


@dataclass(frozen=True, slots=True)
class KeptTensor:
    name: str
    elements: int  # per token
    bytes: float  # per token as stored (elements / 8 for a bitmask)
    storage: str  # "full" or "bitmask"
    producer: str  # the op that writes it, or "input"
    readers: tuple[str, ...]  # surviving backward steps (and recomputations) that read it


@dataclass(frozen=True, slots=True)
class RematTensor:
    name: str
    elements: int  # per token
    producer: str  # the op re-run in the backward pass
    flops: float  # the producer's forward FLOPs per token (what one recomputation costs)


@dataclass(slots=True)
class PruningPlan:
    """What one layer stores between its forward and backward, per token, and why.

    Whole-model figures assume every layer runs the same plan: ``num_layers`` times the
    layer's bytes plus ``head_bytes_per_token``, the gradient at the last layer's output
    (hidden_size elements) that the head computes in the forward window and keeps.
    """

    title: str
    policy: str
    cost_threshold: float  # FLOPs per output element
    memory_target: float  # pass (b): kept bytes as a fraction of keep_set_bytes_per_token, at most
    op_flops: float  # pass (b): what each dispatched operation of a recomputation costs (host time, FLOPs per token)
    training_flops_per_token: float  # one layer's forward and pruned backward
    recompute_flops_per_token: float  # one layer: what the backward pass spends rematerialising
    element_size: int  # bytes
    kept: list[KeptTensor]  # stored, in forward order
    rematerialized: list[RematTensor]  # recomputed in the backward pass, in forward (recompute) order
    surviving: list[BackwardStep]  # the pruned backward graph, in backward order
    pruned: list[BackwardStep]  # removed gradient computations
    kept_bytes_per_token: float  # one layer: sum of kept[].bytes
    keep_all_bytes_per_token: float  # one layer, no pruning: its input and every activation it produces
    #   except its output (the next layer's input, counted there; the last one's is the head's)
    keep_set_bytes_per_token: float  # one layer, pruned, nothing rematerialised (policy ``none``'s kept bytes)
    head_bytes_per_token: float  # the gradient at the last layer's output (the graph output's size)
    num_layers: int = 1
    graph: LayerGraph | None = field(default=None, repr=False, compare=False)

    @property
    def model_kept_bytes_per_token(self) -> float:
        return self.num_layers * self.kept_bytes_per_token + self.head_bytes_per_token

    @property
    def model_keep_all_bytes_per_token(self) -> float:
        return self.num_layers * self.keep_all_bytes_per_token + self.head_bytes_per_token

    def describe(self) -> str:
        """A readable multi-line summary."""
        how = {"cheap": f"rematerialise ops under {self.cost_threshold:g} FLOPs per output element, then the "
                        f"costly tensors adding the fewest FLOPs (and {_num(self.op_flops)} per operation dispatched) "
                        f"that bring the kept bytes to {self.memory_target:.0%} of the pruned keep set's",
               "all": "store the input and the K/V cache, recompute the rest",
               "none": "store the whole keep set"}[self.policy]
        lines = [f"Pruning plan: {self.title}", f"policy {self.policy!r}: {how}",
                 f"kept per token, one layer ({len(self.kept)} tensors):"]
        for k in self.kept:
            lines.append(f"  {k.name:<18} {k.elements:>7} el {_num(k.bytes):>9} B  {k.storage:<7}  "
                         f"from {k.producer}; read by {', '.join(k.readers) or 'the forward (cache)'}")
        remat = ", ".join(f"{r.name} ({r.producer}, {_num(r.flops)} FLOPs)" for r in self.rematerialized)
        lines.append(f"rematerialised ({len(self.rematerialized)}): {remat or '-'}")
        lines.append(f"recompute FLOPs/token, one layer: {_num(self.recompute_flops_per_token)} "
                     f"({self.recompute_flops_per_token / self.training_flops_per_token:.1%} of the "
                     f"{_num(self.training_flops_per_token)} of forward and pruned backward)")
        lines.append(f"backward steps: {len(self.surviving)} kept, {len(self.pruned)} pruned: "
                     f"{', '.join(s.name for s in self.pruned) or '-'}")
        ratio = self.kept_bytes_per_token / self.keep_all_bytes_per_token
        lines.append(f"bytes/token, one layer: kept {_num(self.kept_bytes_per_token)}, pruned keep set "
                     f"{_num(self.keep_set_bytes_per_token)} "
                     f"({self.kept_bytes_per_token / self.keep_set_bytes_per_token:.1%}), keep-all "
                     f"{_num(self.keep_all_bytes_per_token)} ({ratio:.1%})")
        lines.append(f"bytes/token, {self.num_layers} layer(s) + head {_num(self.head_bytes_per_token)}: kept "
                     f"{_num(self.model_kept_bytes_per_token)}, keep-all {_num(self.model_keep_all_bytes_per_token)}")
        return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:,.3f}".rstrip("0").rstrip(".")


def plan_graph(graph: LayerGraph, rematerialize_policy: str = "cheap",
               cost_threshold: float = DEFAULT_COST_THRESHOLD, need_input_grad: bool = True,
               num_layers: int = 1, memory_target: float = DEFAULT_MEMORY_TARGET, op_flops: float = 0.0
               ) -> PruningPlan:
    """Differentiate, prune, pick the keep set, rematerialise and compress any ``LayerGraph``."""
    if rematerialize_policy not in POLICIES:
        raise ValueError(f"rematerialize: must be one of {', '.join(POLICIES)}, got {rematerialize_policy!r}")
    if not cost_threshold > 0:
        raise ValueError(f"cost_threshold: must be positive, got {cost_threshold!r}")
    if not 0 < memory_target <= 1:
        raise ValueError(f"memory_target: must be in (0, 1], got {memory_target!r}")
    if not op_flops >= 0:
        raise ValueError(f"op_flops: must be >= 0, got {op_flops!r}")
    surviving, pruned = prune(graph, differentiate(graph), need_input_grad)
    keep = keep_set(graph, surviving)
    train = training_flops(graph, surviving)
    keep_set_bytes = sum(_bytes(graph, t, how) for t, how in _as_stored(graph, keep).items())
    stored, remat = rematerialize(graph, keep, rematerialize_policy, cost_threshold, memory_target * keep_set_bytes,
                                  op_flops)
    readers: dict[str, list[str]] = {}
    for s in surviving:
        for rd in s.reads:
            readers.setdefault(rd.tensor, []).append(s.name)
    for t in remat:
        for i in graph.producer(t).inputs:
            readers.setdefault(i, []).append(f"recompute {t}")
    order = [graph.input] + [t for op in graph.ops for t in op.outputs]
    kept = [KeptTensor(t, graph.tensors[t].elements, _bytes(graph, t, stored[t]), stored[t],
                       graph.tensors[t].producer or "input", tuple(dict.fromkeys(readers.get(t, []))))
            for t in order if t in stored]
    rematerialized = [RematTensor(t, graph.tensors[t].elements, graph.producer(t).name, graph.producer(t).flops)
                      for t in remat]
    keep_all = sum(_bytes(graph, t, "full") for t in graph.activations() if t != graph.output)
    rerun = {r.producer: r.flops for r in rematerialized}  # an op with several outputs runs once
    return PruningPlan(graph.title, rematerialize_policy, cost_threshold, memory_target, op_flops, train,
                       sum(rerun.values()), graph.element_size, kept,
                       rematerialized, surviving, pruned, sum(k.bytes for k in kept), keep_all, keep_set_bytes,
                       _bytes(graph, graph.output, "full"), num_layers, graph)


def plan_layer(shape: LayerShape, peft_config: Any, rematerialize: str = "cheap",
               cost_threshold: float = DEFAULT_COST_THRESHOLD, need_input_grad: bool = True,
               attention_backward: str = "flash", memory_target: float = DEFAULT_MEMORY_TARGET,
               op_flops: float = 0.0) -> PruningPlan:
    """The plan of one decoder layer (``num_layers`` = 1) with ``peft_config``'s bypasses.

    ``peft_config``: a ``LoraConfig`` / ``IA3Config``, or any object with their attributes
    (see ``build_layer_graph``). ``rematerialize``: "cheap" (default), "all" or "none".
    """
    return plan_graph(build_layer_graph(shape, peft_config, attention_backward), rematerialize, cost_threshold,
                      need_input_grad, memory_target=memory_target, op_flops=op_flops)


def plan_model(shape: LayerShape, peft_config: Any, num_layers: int, rematerialize: str = "cheap",
               cost_threshold: float = DEFAULT_COST_THRESHOLD, attention_backward: str = "flash",
               memory_target: float = DEFAULT_MEMORY_TARGET, op_flops: float = 0.0) -> PruningPlan:
    """The plan every one of ``num_layers`` layers runs; ``model_*_bytes_per_token`` give the totals.

    Every layer keeps its input gradient (the executor runs one plan for all layers); layer 0
    could drop it, which ``plan_layer(..., need_input_grad=False)`` shows.
    """
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_layers: must be a positive integer, got {num_layers!r}")
    plan = plan_layer(shape, peft_config, rematerialize, cost_threshold, attention_backward=attention_backward,
                      memory_target=memory_target, op_flops=op_flops)
    plan.num_layers = num_layers
    return plan
