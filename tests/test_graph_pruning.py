"""Graph pruning plans (FlexLLM §5.2): keep sets reasoned by hand, and properties over random configs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.finetune.graph import (TARGET_MODULES, GraphBuilder, LayerGraph, LayerShape, OpKind, TensorKind,
                                    build_layer_graph)
from coserve.finetune.graph_pruning import PruningPlan, plan_graph, plan_layer, plan_model
from coserve.peft.config import IA3Config, LoraConfig

SHAPE = LayerShape(hidden_size=512, intermediate_size=1408, num_heads=8, num_kv_heads=2, head_dim=64,
                   element_size=4)
FROZEN_ONLY = {"h_attn", "h_mlp", "q_pre", "k_pre", "attn_proj", "mlp_out"}  # read only by frozen dW


def stored(plan: PruningPlan) -> dict[str, str]:
    return {k.name: k.storage for k in plan.kept}


def remat(plan: PruningPlan) -> set[str]:
    return {r.name for r in plan.rematerialized}


def step_keys(plan: PruningPlan) -> set[tuple[str, int]]:
    return {s.key for s in plan.surviving}


def reads_of(plan: PruningPlan, op: str, wrt: str) -> set[str]:
    (step,) = [s for s in plan.surviving if s.op == op and s.wrt == wrt]
    return {r.tensor for r in step.reads}


def test_lora_down_proj_keeps_what_its_gradients_read():
    plan = plan_layer(SHAPE, LoraConfig(r=16, target_modules=["down_proj"]), rematerialize="none")
    # dB = dL/dxAB^T xA reads xA; dA = (dL/dxA)^T x reads the down_proj input; dL/dxA reads B only.
    assert reads_of(plan, "down_proj.lora_B", "down_proj.lora_B.W") == {"down_proj.lora_a"}
    assert reads_of(plan, "down_proj.lora_A", "down_proj.lora_A.W") == {"mlp_in"}
    assert reads_of(plan, "down_proj.lora_B", "down_proj.lora_a") == {"down_proj.lora_B.W"}
    keep = stored(plan)
    assert keep["mlp_in"] == "full" and keep["down_proj.lora_a"] == "full"
    assert not FROZEN_ONLY & set(keep)
    assert {s.wrt for s in plan.pruned} == {f"{m}.W" for m in TARGET_MODULES} | {"attn_norm.w", "mlp_norm.w"}
    cheap = plan_layer(SHAPE, LoraConfig(r=16, target_modules=["down_proj"]), memory_target=1.0)
    # The down_proj input is cheap to recompute from gate and up (SiLU, multiply). The norms' per-row statistics are
    # not: each is a reduction over its row for one float32 a token, so it is stored.
    assert remat(cheap) == {"mlp_in", "act"}
    half = plan_layer(dataclasses.replace(SHAPE, element_size=2), LoraConfig(r=16, target_modules=["down_proj"]))
    for plan in (cheap, half):  # float32 in every dtype, as the executors compute them
        assert {k.name: k.bytes for k in plan.kept if k.name.startswith("rms")} == {"rms_attn": 4, "rms_mlp": 4}
    assert set(stored(cheap)) == {"x", "rms_attn", "q", "k", "v", "attn.o", "attn.lse", "resid", "rms_mlp", "gate",
                                  "up", "down_proj.lora_a"}
    assert not FROZEN_ONLY & (set(stored(cheap)) | remat(cheap))
    assert cheap.kept_bytes_per_token == 4 * (512 + 1 + 512 + 128 + 128 + 512 + 8 + 512 + 1 + 1408 + 1408 + 16)


def test_lora_all_linear_modules():
    plan = plan_layer(SHAPE, LoraConfig(r=8, target_modules=list(TARGET_MODULES)), memory_target=1.0)
    keep, re = stored(plan), remat(plan)
    assert {f"{m}.lora_a" for m in TARGET_MODULES} <= set(keep)  # each dB reads its xA
    assert {"h_attn", "h_mlp", "mlp_in"} <= re  # dA inputs, recomputed from x / resid / gate, up
    assert "attn.o" in keep  # o_proj's dA and attention's backward
    assert not {"q_pre", "k_pre", "attn_proj", "mlp_out"} & (set(keep) | re)
    assert len(plan.pruned) == 9  # the seven frozen W and two norm weights
    assert step_keys(plan_layer(SHAPE, LoraConfig(r=8, target_modules=["down_proj"]))) < step_keys(plan)


def test_ia3_default_scales_k_v_outputs_and_down_proj_input():
    plan = plan_layer(SHAPE, IA3Config(), rematerialize="none")
    assert reads_of(plan, "k_proj.ia3", "k_proj.ia3_l") == {"k_proj.y"}
    assert reads_of(plan, "v_proj.ia3", "v_proj.ia3_l") == {"v_proj.y"}
    assert reads_of(plan, "down_proj.ia3", "down_proj.ia3_l") == {"mlp_in"}
    assert {"k_proj.y", "v_proj.y", "mlp_in"} <= set(stored(plan))
    assert "down_proj.in" not in stored(plan)  # only the frozen dW would read the scaled input
    cheap = plan_layer(SHAPE, IA3Config())
    assert {"k_proj.y", "v_proj.y"} <= set(stored(cheap)) and "mlp_in" in remat(cheap)


def test_all_policy_keeps_only_input_and_kv_cache():
    for cfg in (LoraConfig(target_modules=["down_proj"]), LoraConfig(target_modules=list(TARGET_MODULES)),
                IA3Config()):
        plan = plan_layer(SHAPE, cfg, rematerialize="all")
        assert set(stored(plan)) == {"x", "k", "v"}
        assert plan.kept_bytes_per_token == (512 + 2 * 128) * 4


def test_byte_ordering_and_model_totals():
    cfg = LoraConfig(r=16, target_modules=["down_proj"])
    cheap, none = plan_layer(SHAPE, cfg, memory_target=1.0), plan_layer(SHAPE, cfg, rematerialize="none")
    assert cheap.kept_bytes_per_token < none.kept_bytes_per_token < cheap.keep_all_bytes_per_token
    model = plan_model(SHAPE, cfg, num_layers=6, memory_target=1.0)
    assert model.model_kept_bytes_per_token == 6 * cheap.kept_bytes_per_token + 512 * 4
    assert model.model_keep_all_bytes_per_token == 6 * cheap.keep_all_bytes_per_token + 512 * 4
    text = model.describe()
    assert "mlp_in" in text and "20,584" in text and "6 layer(s)" in text


def test_memory_target_recomputes_what_costs_fewest_flops():
    down = LoraConfig(r=16, target_modules=["down_proj"])
    # At 512 keys per token (1,024-token sequences) attention costs ~1.07 MFLOPs per 2,080 B kept; the
    # pruned keep set is 31,848 B and half of it is reached most cheaply by recomputing one of gate/up
    # (2 x 512 x 1408 FLOPs for 5,632 B): cheaper than q + resid + attention together (6,176 B).
    plan = plan_layer(SHAPE, down)
    assert plan.keep_set_bytes_per_token == plan_layer(SHAPE, down, rematerialize="none").kept_bytes_per_token
    assert plan.keep_set_bytes_per_token == 31848
    assert set(stored(plan)) == {"x", "rms_attn", "k", "v", "q", "attn.o", "attn.lse", "resid", "rms_mlp", "up",
                                 "down_proj.lora_a"}
    assert "gate" in remat(plan)
    assert plan.kept_bytes_per_token <= 0.5 * plan.keep_set_bytes_per_token
    assert plan.kept_bytes_per_token == 4 * (512 + 1 + 128 + 128 + 512 + 512 + 8 + 512 + 1 + 1408 + 16)
    assert "50% of the pruned keep set" in plan.describe()
    # Short sequences make attention cheap: then recomputing q, attention and the residual wins.
    short = plan_layer(dataclasses.replace(SHAPE, context_tokens=32), down)
    assert set(stored(short)) == {"x", "rms_attn", "k", "v", "rms_mlp", "gate", "up", "down_proj.lora_a"}
    assert {"q", "attn.o", "resid"} <= remat(short)
    # LoRA on every linear module: q and the residual (1.05 MFLOPs) bring it under the target.
    every = plan_layer(SHAPE, LoraConfig(r=16, target_modules=list(TARGET_MODULES)))
    assert not {"q", "resid"} & set(stored(every)) and {"attn.o", "gate", "up"} <= set(stored(every))
    sizes = [plan_layer(SHAPE, down, memory_target=t).kept_bytes_per_token for t in (1.0, 0.7, 0.5, 0.35, 0.01)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[2] > sizes[-1]
    # Unreachable: everything costly recomputed, the fewest bytes kept.
    everything = plan_layer(SHAPE, down, memory_target=0.01)
    assert not {"q", "attn.o", "attn.lse", "resid", "gate", "up"} & set(stored(everything))
    recompute = plan_layer(SHAPE, down, attention_backward="recompute")  # attention is recomputed anyway
    assert "attn.o" not in stored(recompute) and recompute.kept_bytes_per_token <= 0.5 * recompute.keep_set_bytes_per_token
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="memory_target"):
            plan_layer(SHAPE, down, memory_target=bad)


def test_a_charge_per_dispatched_operation_keeps_attention_where_launching_ops_is_what_costs():
    down = LoraConfig(r=16, target_modules=["down_proj"])
    short = dataclasses.replace(SHAPE, context_tokens=16)  # 32-token sequences
    flops_only = plan_layer(short, down)
    assert {"q", "attn.o", "resid"} <= remat(flops_only)  # attention is the fewest FLOPs to recompute
    # The CPU's charge (2e6 FLOPs an operation, over 32 tokens): recomputing q, attention and the residual dispatches
    # 2 + 4 + 25 + 2 + 1 operations (q's projection and rotation, attention, the output projection, the add), the
    # gate projection 2, so the gate goes and attention's output stays.
    charged = plan_layer(short, down, op_flops=2e6 / 32)
    assert {"q", "attn.o", "attn.lse", "resid", "up"} <= set(stored(charged)) and "gate" in remat(charged)
    assert charged.kept_bytes_per_token <= 0.5 * charged.keep_set_bytes_per_token  # the same memory target
    assert "per operation dispatched" in charged.describe()
    # 1,024-token sequences: FLOPs decide as they did (the finetuning benchmark's plan on the CPU is unchanged).
    for peft in (down, LoraConfig(r=16, target_modules=list(TARGET_MODULES)), IA3Config()):
        assert stored(plan_layer(SHAPE, peft, op_flops=2e6 / 1024)) == stored(plan_layer(SHAPE, peft))
    with pytest.raises(ValueError, match="op_flops"):
        plan_layer(SHAPE, down, op_flops=-1.0)


def test_first_layer_without_input_gradient_prunes_to_the_bypass():
    plan = plan_layer(SHAPE, LoraConfig(r=16, target_modules=["down_proj"]), need_input_grad=False)
    assert {s.op for s in plan.surviving} == {"mlp_residual", "down_proj.lora_add", "down_proj.lora_scale",
                                             "down_proj.lora_B", "down_proj.lora_A"}
    assert stored(plan) == {"x": "full", "k": "full", "v": "full", "mlp_in": "full",
                            "down_proj.lora_a": "full"}  # mlp_in's inputs are not kept: no recompute


def relu_mlp(lora_on_fc2: bool) -> LayerGraph:
    """x -> fc1 (+LoRA) -> z -> ReLU -> r -> fc2 (+LoRA optionally) -> out: the paper's Figure 5 shape."""
    b = GraphBuilder(element_size=2)
    h, f, r = 64, 256, 4

    def lora(name: str, x: str, fan_in: int, fan_out: int, out: str) -> str:
        y = b.matmul(name, x, fan_in, fan_out, f"{name}.y")
        xa = b.matmul(f"{name}.lora_A", x, fan_in, r, f"{name}.lora_a", trainable=True)
        xb = b.matmul(f"{name}.lora_B", xa, r, fan_out, f"{name}.lora_b", trainable=True)
        return b.pointwise(f"{name}.add", OpKind.ADD, "add", (y, xb), out)

    x = b.input("x", h)
    z = lora("fc1", x, h, f, "z")
    act = b.pointwise("relu", OpKind.ACTIVATION, "relu", (z,), "r")
    out = lora("fc2", act, f, h, "out") if lora_on_fc2 else b.matmul("fc2", act, f, h, "out")
    return b.build(x, out, always_kept=(x,), required_grads=(x,))


def test_relu_input_kept_as_bitmask():
    plan = plan_graph(relu_mlp(lora_on_fc2=False))
    assert stored(plan) == {"x": "full", "z": "bitmask", "fc1.lora_a": "full"}
    (z,) = [k for k in plan.kept if k.name == "z"]
    assert z.bytes == 256 / 8
    assert plan.kept_bytes_per_token == 64 * 2 + 32 + 4 * 2
    assert "bitmask" in plan.describe()


def test_relu_output_rematerialised_from_full_input_when_cheaper():
    none = plan_graph(relu_mlp(lora_on_fc2=True), "none")
    assert stored(none)["z"] == "bitmask" and stored(none)["r"] == "full"  # fc2's dA reads r
    cheap = plan_graph(relu_mlp(lora_on_fc2=True))
    # Storing z in full (512 B) and recomputing r beats r in full plus z's bitmask (512 + 32 B).
    assert stored(cheap)["z"] == "full" and remat(cheap) == {"r"}
    assert cheap.kept_bytes_per_token < none.kept_bytes_per_token


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="rematerialize"):
        plan_layer(SHAPE, LoraConfig(), rematerialize="some")
    with pytest.raises(ValueError, match="num_kv_heads"):
        LayerShape(512, 1408, 8, 3, 64)
    with pytest.raises(ValueError, match="peft_type"):
        build_layer_graph(SHAPE, object())


def test_graph_matches_the_decoder():
    from types import SimpleNamespace

    from coserve.model import decoder
    from coserve.model.config import ModelConfig
    cfg = ModelConfig("Qwen2ForCausalLM", vocab_size=100, hidden_size=96, intermediate_size=160, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, qkv_bias=True, torch_dtype="bfloat16")
    shape = LayerShape.from_model_config(cfg, element_size=2)
    assert shape.module_shapes() == decoder.DecoderModel.module_shapes(SimpleNamespace(cfg=cfg))
    graph = build_layer_graph(shape, LoraConfig(r=4, target_modules=["q_proj"]))
    assert graph.op("q_proj").inputs == ("h_attn", "q_proj.W", "q_proj.b")
    assert graph.op("q_proj").flops == 2 * 96 * 96 and graph.op("q_proj.lora_A").flops == 2 * 96 * 4
    assert "q_norm" not in {op.name for op in graph.ops}
    # Phi-3's fused modules are priced as their parts: a bypass on each, reading the same input
    fused = build_layer_graph(shape, LoraConfig(r=4, target_modules=["qkv_proj", "gate_up_proj"]))
    assert {op.name for op in fused.ops if op.name.endswith(".lora_A")} == {
        "q_proj.lora_A", "k_proj.lora_A", "v_proj.lora_A", "gate_proj.lora_A", "up_proj.lora_A"}


def test_graph_of_qwen3_normalises_q_and_k_per_head_before_the_rotation():
    """Qwen3's q/k norms: each reads the projection's output (after its bypass) and writes one float32 statistic a
    head; the rotation reads the norm; the executor's keeps (``q_pre``, ``q_rms``, ``k_pre``, ``k_rms``) are the
    graph's names, and a plan may recompute the norms' inputs from the layer input."""
    from coserve.finetune.pruned_layer import BASE_KEEPS
    from coserve.model.config import ModelConfig
    cfg = ModelConfig("Qwen3ForCausalLM", vocab_size=100, hidden_size=96, intermediate_size=160, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, qkv_bias=False, torch_dtype="float32", qk_norm=True)
    shape = LayerShape.from_model_config(cfg, element_size=4)
    assert shape.qk_norm
    graph = build_layer_graph(shape, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    assert graph.op("q_norm").inputs == ("q_pre", "q_norm.w") and graph.op("q_norm").outputs == ("q_normed", "q_rms")
    assert graph.op("k_norm").inputs == ("k_pre", "k_norm.w")
    assert graph.op("rope_q").inputs[0] == "q_normed" and graph.op("rope_k").inputs[0] == "k_normed"
    assert graph.tensors["q_rms"].elements == 6 and graph.tensors["k_rms"].elements == 2
    assert graph.tensors["q_rms"].element_size == 4
    assert {"q_pre", "k_pre"} <= set(graph.projections)
    for policy in ("cheap", "none"):
        plan = plan_layer(shape, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]), policy)
        stored = {k.name for k in plan.kept}
        assert {"q_rms", "k_rms"} <= stored  # read by the norms' backward, a reduction to recompute
        assert {"q_pre", "k_pre"} & (stored | {r.name for r in plan.rematerialized}) == {"q_pre", "k_pre"}
        if policy == "cheap":  # what the executors run: every stored tensor is one they can keep
            assert stored - set(BASE_KEEPS) - {"x", "k", "v"} <= {"q_proj.lora_a", "down_proj.lora_a"}


def test_modules_import_without_torch():
    code = ("import sys; import coserve.finetune.graph_pruning; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- properties over random shapes and PEFT configs ----

@st.composite
def shapes(draw) -> LayerShape:
    kv = draw(st.integers(1, 4))
    return LayerShape(hidden_size=draw(st.integers(8, 4096)), intermediate_size=draw(st.integers(8, 8192)),
                      num_heads=kv * draw(st.integers(1, 4)), num_kv_heads=kv,
                      head_dim=draw(st.sampled_from([8, 16, 64, 128])), qkv_bias=draw(st.booleans()),
                      qk_norm=draw(st.booleans()), element_size=draw(st.sampled_from([2, 4])))


@st.composite
def nested_configs(draw):
    """A PEFT config and one with a superset of its target modules."""
    big = draw(st.lists(st.sampled_from(TARGET_MODULES), min_size=1, unique=True))
    small = draw(st.lists(st.sampled_from(big), min_size=1, unique=True))
    if draw(st.booleans()):
        r = draw(st.integers(1, 64))
        return LoraConfig(r=r, target_modules=small), LoraConfig(r=r, target_modules=big)
    ff = [m for m in big if m in ("o_proj", "down_proj") and draw(st.booleans())]
    return (IA3Config(target_modules=small, feedforward_modules=[m for m in ff if m in small]),
            IA3Config(target_modules=big, feedforward_modules=ff))


def assert_closed(plan: PruningPlan) -> None:
    """Every read of a surviving step is a weight/index, stored, or rematerialised from stored tensors."""
    g = plan.graph
    keep, re = stored(plan), remat(plan)

    def available(t: str) -> bool:  # in full, in the backward pass
        if g.tensors[t].kind is not TensorKind.ACTIVATION or keep.get(t) == "full":
            return True
        if t not in re:
            return False
        inputs = g.producer(t).inputs
        if plan.policy == "all":  # a recomputation of the layer from x (and the K/V cache)
            return all(derivable(i) for i in inputs)
        return all(available(i) for i in inputs)

    def derivable(t: str) -> bool:
        op = g.producer(t)
        return available(t) or (op is not None and all(derivable(i) for i in op.inputs))

    for s in plan.surviving:
        for rd in s.reads:
            assert (rd.sign_only and rd.tensor in keep) or available(rd.tensor), (s.name, rd.tensor)
    assert all(available(t) for t in re)
    assert {"x", "k", "v"} <= {t for t, how in keep.items() if how == "full"}
    if plan.policy == "none":
        assert not re
    if plan.policy == "cheap":  # costly tensors recomputed only to meet the memory target
        met = plan.kept_bytes_per_token <= plan.memory_target * plan.keep_set_bytes_per_token
        assert met or not {t for t, how in keep.items() if how == "full"} & (set(g.projections) - set(g.always_kept))


@settings(max_examples=60, deadline=None)
@given(shape=shapes(), configs=nested_configs(), need_input_grad=st.booleans())
def test_plans_are_closed_monotone_and_ordered(shape, configs, need_input_grad):
    small, big = configs
    plans = {}
    for cfg in (small, big):
        for policy in ("all", "cheap", "none"):
            plan = plan_layer(shape, cfg, rematerialize=policy, need_input_grad=need_input_grad)
            assert_closed(plan)
            plans[id(cfg), policy] = plan
        b_all, b_cheap, b_none = (plans[id(cfg), p].kept_bytes_per_token for p in ("all", "cheap", "none"))
        assert b_all <= b_cheap <= b_none <= plans[id(cfg), "cheap"].keep_all_bytes_per_token
        assert b_all == (shape.hidden_size + 2 * shape.kv_size) * shape.element_size
    assert step_keys(plans[id(small), "cheap"]) <= step_keys(plans[id(big), "cheap"])
