"""Adapters of a mixture's experts (HF PEFT's ``LoraConfig(target_parameters=["experts.gate_up_proj",
"experts.down_proj"])``, coserve/peft/expert_lora.py), of its router and of Qwen2-MoE's shared expert, and PEFT's names
on a mixture (``all-linear``, transformers 4's, its layout of one LoRA per expert). PEFT is the oracle of serving
(greedy tokens, logprobs, a batch mixing adapters and the base), of the file layout both ways, of the names, and of
training (test_finetune_vs_peft.py); a co-served job training the experts changes no inference logprob, the experts'
adapters of inference requests included; windows match one whole-sequence autograd backward; the executor keeps
exactly the planner's bytes; what is not supported is refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from coserve import LLM, SamplingParams
from coserve.model.loader import load_model
from coserve.peft.adapter_dir import AdapterError
from coserve.peft.config import LoraConfig, for_model
from coserve.peft.trainable import TrainableLora, load_model_trainable
from peft_helpers import check_mixed_batch_matches_peft, lora_adapters_per_model, make_lora_adapter, peft_model
from tests.test_coserving import _engine
from tests.test_cuda_architectures import _every_module_job
from window_helpers import check_windows_match_autograd, perturbed_bypass

MOES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "glm4_moe", "gpt_oss")
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
PROMPTS = ["The quick brown fox", "def add(a, b):", "A", "Scheduling decides which tokens run", "Once upon", "JSON"]


@pytest.fixture(scope="module")
def expert_adapters(tmp_path_factory):
    """Per model: ``experts`` (q_proj, the router's weight and both expert parameters, r=4; PEFT 0.21 adapts Qwen2-MoE's
    router only so) and ``down`` (the experts' down projection alone, PEFT's bare parameter name, r=2 with rsLoRA)."""
    return lora_adapters_per_model(tmp_path_factory, "expert-adapters", {
        "experts": dict(seed=1, r=4, lora_alpha=8, target_modules=["q_proj"],
                        target_parameters=["gate.weight", *EXPERTS]),
        "down": dict(seed=2, r=2, lora_alpha=4, use_rslora=True, target_modules=[], target_parameters=["down_proj"]),
    })


@pytest.mark.parametrize("arch", MOES)
def test_a_batch_mixing_expert_adapters_and_the_base_matches_peft(model_factory, hf_model_cache, expert_adapters,
                                                                   arch):
    model_dir = model_factory(arch)
    check_mixed_batch_matches_peft(model_dir, hf_model_cache(model_dir), expert_adapters(model_dir),
                                   [None, "experts", "down", "experts", "down", None], PROMPTS, 16)


def test_expert_adapter_logprobs_match_peft(model_factory, expert_adapters):
    model_dir = model_factory("mixtral")
    path = expert_adapters(model_dir)["experts"]
    llm = LLM(model_dir, dtype="float32", device="cpu")
    llm.load_adapter("experts", path)
    ids = llm.tokenizer(PROMPTS[3])["input_ids"]
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=5), adapter="experts")[0]
    with torch.inference_mode():
        ref = peft_model(model_dir, path)(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    for token, lp in out.outputs[0].logprobs[0].top.items():
        assert abs(lp - ref[token].item()) < 1e-4


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_co_served_requests_on_expert_adapters_get_the_same_logprobs_bit_for_bit(model_factory, expert_adapters,
                                                                                  tmp_path, arch):
    """Requests on both expert adapters and on the base, alone and beside a job training the attention and the
    experts: each expert's call then holds inference rows of several adapters and finetuning rows, and each kind's
    adapter runs over its own rows."""
    from tests.test_batch_invariance import _prompts
    model_dir = model_factory(arch)
    paths = expert_adapters(model_dir)

    def logprobs(engine):
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
        ids = [engine.add_request(p, params, adapter=[None, "experts", "down"][i % 3])
               for i, p in enumerate(_prompts(11))]
        done = {}
        while len(done) < len(ids) or engine.has_running_jobs():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return [[(lp.token_id, lp.logprob, lp.top) for lp in done[i].outputs[0].logprobs] for i in ids]

    engines = [_engine(model_dir), _engine(model_dir)]
    for engine in engines:
        for name, path in paths.items():
            engine.load_adapter(name, path)
    alone = logprobs(engines[0])
    job = _every_module_job(engines[1], tmp_path / "job")
    assert job.bypass.config.target_parameters == EXPERTS
    engines[1].add_finetune_job(job)
    assert logprobs(engines[1]) == alone
    assert job.tokens_done > 0


TARGETS = {"attention-and-experts": (["q_proj", "o_proj"], EXPERTS), "gate-up": ([], ["experts.gate_up_proj"]),
           "down": ([], ["experts.down_proj"]), "router-and-experts": (["gate", "v_proj"], EXPERTS),
           "router": (["gate"], [])}


@pytest.mark.parametrize("remat", ["cheap", "cheap:every", "cheap:none", "all"])
@pytest.mark.parametrize("arch,targets", [pytest.param(arch, targets, id=f"{name}-{arch}") for name, targets
                                          in TARGETS.items() for arch in MOES
                                          if not (arch == "gpt_oss" and "gate" in targets[0])])  # no router module
def test_expert_windows_match_one_whole_sequence_backward(model_factory, arch, targets, remat):
    """With the experts or the router alone adapted, the first layer's backward stops after its mixture (its input
    needs no gradient). gpt-oss: through its experts' biases and clamped SwiGLU, its gate/up's rows as coserve holds
    them."""
    model = load_model(model_factory(arch), torch.float32, torch.device("cpu"))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets[0], target_parameters=targets[1])
    bypass = perturbed_bypass(config, model, seed=5)
    check_windows_match_autograd(model, bypass, 41, remat, (7, 1, 22, 11), [1, 4, 13, 41], seed=3, tol=2e-5)


def test_the_file_layout_is_pefts_both_ways(model_factory, expert_adapters, tmp_path):
    """PEFT's adapter loads trainable into coserve with every tensor as PEFT holds it; coserve's saved adapter loads
    into PEFT with the same delta weight of every expert, and its config names the parameters as PEFT's does (the
    router's weight among them, as PEFT 0.21 adapts it)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    model_dir = model_factory("qwen3_moe")
    path = expert_adapters(model_dir)["experts"]
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    bypass = load_model_trainable(path, model)
    theirs = load_file(str(path / "adapter_model.safetensors"))
    ours = bypass.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    out = tmp_path / "saved"
    with torch.no_grad():
        for p in bypass.parameters():
            p.mul_(1.5)
    bypass.save_pretrained(out, base_model=str(model_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["gate.weight", *EXPERTS] and config["target_modules"] == ["q_proj"]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                                     str(out))
    for layer in range(model.cfg.num_layers):
        experts = peft.base_model.model.model.layers[layer].mlp.experts
        for wrapper, module in ((experts.base_layer, "experts.gate_up_proj"), (experts, "experts.down_proj")):
            a, b = bypass.ea[(layer, module)], bypass.eb[(layer, module)]
            mine = torch.einsum("eor,eri->eoi", b, a) * bypass.scaling
            assert torch.allclose(wrapper.get_delta_weight("default"), mine, atol=1e-6)


def test_what_is_not_supported_is_refused_naming_the_field(model_factory, expert_adapters, tmp_path):
    dense = load_model(model_factory("llama"), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="target_parameters: .* this model is no mixture of experts"):
        for_model(LoraConfig(target_parameters=EXPERTS), dense.module_shapes(), dense.expert_shapes())
    with pytest.raises(ValueError, match="target_parameters: 'router' is not an expert parameter"):
        LoraConfig(target_parameters=["router"])
    with pytest.raises(ValueError, match="target_parameters: '7.mlp.experts.down_proj' is not an expert parameter"):
        LoraConfig(target_parameters=["7.mlp.experts.down_proj"])
    with pytest.raises(ValueError, match="lora_dropout: must be 0 with target_parameters"):
        LoraConfig(target_parameters=EXPERTS, lora_dropout=0.1)
    with pytest.raises(ValueError, match="use_dora: DoRA does not adapt experts"):
        LoraConfig(target_parameters=EXPERTS, use_dora=True)
    # the router as PEFT 0.21 adapts it (a parameter): LoRA, without dropout or DoRA; no IA3
    from coserve.peft.config import IA3Config
    moe = load_model(model_factory("olmoe"), torch.float32, torch.device("cpu"))
    for bad, message in ((LoraConfig(target_modules=["gate"], lora_dropout=0.1), "lora_dropout: a mixture's router"),
                         (LoraConfig(target_modules=["q_proj", "gate"], use_dora=True), "use_dora: a mixture's router"),
                         (IA3Config(target_modules=["gate"], feedforward_modules=[]), "target_modules: IA3 of a")):
        with pytest.raises(ValueError, match=message):
            for_model(bad, moe.module_shapes(), moe.expert_shapes())
    assert LoraConfig(target_parameters=["down_proj"]).target_modules == []  # the experts alone
    assert LoraConfig().target_modules == ["down_proj"]
    # an experts' adapter on a dense model, or one whose shapes do not fit: the file and tensor named
    path = expert_adapters(model_factory("mixtral"))["experts"]
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    with pytest.raises(AdapterError, match="adapter_config.json: field target_parameters: .* no mixture of experts"):
        llm.load_adapter("x", path)
    other = tmp_path / "other"
    make_lora_adapter(model_factory("qwen3_moe"), other, r=4, lora_alpha=8, target_modules=["q_proj"],
                      target_parameters=EXPERTS)
    with pytest.raises(AdapterError, match=r"layer 0's experts have lora_A \(16, 64\) and lora_B"):
        LLM(model_factory("mixtral"), dtype="float32", device="cpu").load_adapter("x", other)


def test_a_trainable_experts_adapter_starts_as_pefts_does(model_factory):
    """A fresh adapter of the experts: A drawn as PEFT's ``nn.Linear(in, E * r)`` (Kaiming-uniform bound 1/sqrt(in)),
    B zeros, so that it starts as the base model."""
    model = load_model(model_factory("olmoe"), torch.float32, torch.device("cpu"))
    bypass = TrainableLora(LoraConfig(r=3, target_parameters=EXPERTS), model.module_shapes(), model.cfg.num_layers,
                           model.device, torch.Generator().manual_seed(0), experts=model.expert_shapes())
    e, h, i = model.cfg.num_experts, model.cfg.hidden_size, model.cfg.intermediate_size
    a, b = bypass.ea[(0, "experts.gate_up_proj")], bypass.eb[(0, "experts.gate_up_proj")]
    assert a.shape == (e, 3, h) and b.shape == (e, 2 * i, 3) and not b.any()
    assert a.abs().max() <= h ** -0.5 and a.std() > 0.5 * h ** -0.5 / 3 ** 0.5
    assert bypass.ea[(0, "experts.down_proj")].shape == (e, 3, i)
    assert set(bypass.modules) == set(EXPERTS)


def test_coserve_finetune_trains_the_experts_into_an_adapter_the_engine_serves(model_factory, tmp_path, capsys):
    """``coserve finetune --target-parameters``: the adapter names the experts as PEFT does and serves; IA3 of the
    experts is refused naming the option."""
    from coserve.cli import main
    model_dir = model_factory("olmoe")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"Sample {i}: the quick brown fox jumps."}) + "\n" for i in range(4)))
    out = tmp_path / "adapter"
    args = ["finetune", "--model", str(model_dir), "--data", str(data), "--output", str(out), "--max-steps", "2",
            "--batch-size", "2", "--lr", "0.05", "--lora-r", "2", "--target-modules", "q_proj", "--no-progress",
            "--target-parameters", "experts.gate_up_proj,experts.down_proj"]
    assert main(args) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj"] and config["target_parameters"] == EXPERTS
    llm = LLM(model_dir, dtype="float32", device="cpu")
    llm.load_adapter("tuned", out)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), adapter="tuned")[0].token_ids)
    capsys.readouterr()
    assert main(args[:-2] + ["--peft", "ia3", "--target-parameters", "experts.down_proj"]) != 0
    assert "--target-parameters: only LoRA adapts experts" in capsys.readouterr().err


@pytest.mark.parametrize("arch,targets", [("mixtral", "all-linear"), ("qwen3_moe", "all-linear"),
                                          ("olmoe", "all-linear"), ("mixtral", ["q_proj", "w1", "w3", "w2"]),
                                          ("mixtral", ["w2"]), ("qwen3_moe", ["gate_proj", "up_proj", "down_proj"]),
                                          ("olmoe", ["gate_proj", "up_proj"]), ("qwen2_moe", "all-linear"),
                                          ("qwen2_moe", ["gate_proj", "up_proj", "down_proj"]),
                                          ("qwen2_moe", ["q_proj", "shared_expert_gate"]),
                                          ("glm4_moe", "all-linear"),
                                          ("glm4_moe", ["gate_proj", "up_proj", "down_proj"]),
                                          ("glm4_moe", ["down_proj", "o_proj"]), ("gpt_oss", "all-linear")])
def test_pefts_names_on_a_mixture_adapt_what_peft_adapts(model_factory, arch, targets):
    """PEFT 0.21 on transformers 5 reads ``all-linear`` (the attention, the router and both expert parameters) and
    transformers 4's names of the experts (Mixtral's w1/w3/w2, the others' gate_proj/up_proj/down_proj) as the
    experts' parameters, gate and up together at twice the rank and alpha (``rank_pattern``); on Qwen2-MoE those
    names, and ``all-linear`` beside the attention, are its shared expert's modules; on GLM-4.5 the experts' again,
    in its mixture's layers alone (not its dense first layer's MLP, nor its shared experts); on gpt-oss ``all-linear``
    is the attention alone: coserve's adapter has PEFT's tensors, name for name and shape for shape, and its
    config."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    path = model_factory(arch)
    model = load_model(path, torch.float32, torch.device("cpu"))
    cfg = for_model(LoraConfig(r=4, lora_alpha=8, target_modules=targets), model.module_shapes(),
                    model.expert_shapes())
    ours = TrainableLora(cfg, model.module_shapes(), model.cfg.num_layers, model.device, experts=model.expert_shapes())
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(str(path)),
                          PeftLoraConfig(r=4, lora_alpha=8, target_modules=targets))
    theirs = {n.replace(".default", ""): tuple(p.shape) for n, p in peft.named_parameters() if p.requires_grad}
    assert {n: tuple(t.shape) for n, t in ours.state_dict().items()} == theirs
    saved = ours.peft_config("")
    pc = peft.peft_config["default"]
    assert set(saved["target_parameters"] or ()) == {f"experts.{p}" if "gate.weight" != p else p
                                                     for p in pc.target_parameters or ()}
    assert saved["rank_pattern"] == pc.rank_pattern and saved["alpha_pattern"] == pc.alpha_pattern


def test_glms_shared_experts_and_dense_mlps_are_refused_naming_the_field(model_factory):
    """GLM-4.5's shared experts and its dense layers' MLP take no adapter here yet: PEFT's names of them are refused,
    naming the field, not trained as something else."""
    glm = load_model(model_factory("glm4_moe"), torch.float32, torch.device("cpu"))
    for targets in (["shared_experts.down_proj"], ["mlp.shared_experts.gate_proj", "q_proj"]):
        with pytest.raises(ValueError, match=r"target_modules: unknown module\(s\) \[.*shared_experts"):
            for_model(LoraConfig(target_modules=targets), glm.module_shapes(), glm.expert_shapes())


def test_transformers_4_names_refused_as_peft_refuses_them(model_factory):
    moe = load_model(model_factory("olmoe"), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="target_modules: gate_proj without up_proj: the experts' two are fused"):
        for_model(LoraConfig(target_modules=["gate_proj"]), moe.module_shapes(), moe.expert_shapes())
    with pytest.raises(ValueError, match="alpha_pattern: experts.gate_up_proj at r=8, lora_alpha=8 scales"):
        TrainableLora(LoraConfig(r=4, lora_alpha=8, target_parameters=EXPERTS, rank_pattern={"gate_up_proj": 8}),
                      moe.module_shapes(), moe.cfg.num_layers, moe.device, experts=moe.expert_shapes())


@pytest.mark.parametrize("remat", ["cheap", "cheap:every", "all"])
@pytest.mark.parametrize("peft", [LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=[
    "gate_proj", "up_proj", "down_proj", "shared_expert_gate", "k_proj"]), "ia3"], ids=["lora-dropout", "ia3"])
def test_the_shared_experts_adapters_windows_match_one_whole_sequence_backward(model_factory, peft, remat):
    """Qwen2-MoE's shared expert's modules (PEFT's gate_proj, up_proj, down_proj there) and its gate: LoRA with
    dropout; IA3 scaling their outputs."""
    from coserve.peft.config import IA3Config
    model = load_model(model_factory("qwen2_moe"), torch.float32, torch.device("cpu"))
    if peft == "ia3":
        peft = IA3Config(target_modules=["shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate"],
                         feedforward_modules=[])
    check_windows_match_autograd(model, perturbed_bypass(peft, model, seed=6), 37, remat, (9, 1, 27), [1, 5, 37],
                                 seed=2, tol=2e-5)


def test_a_qwen2_moe_all_linear_adapter_serves_as_peft_serves_it(model_factory, hf_model_cache, tmp_path):
    """PEFT's ``all-linear`` on Qwen2-MoE (the attention and the shared expert's four modules), in a batch with the
    base model, and one on the experts' parameters and the router's weight."""
    model_dir = model_factory("qwen2_moe")
    paths = {"all": make_lora_adapter(model_dir, tmp_path / "all", seed=4, r=4, lora_alpha=8,
                                      target_modules="all-linear"),
             "experts": make_lora_adapter(model_dir, tmp_path / "experts", seed=5, r=2, lora_alpha=4,
                                          target_modules=["shared_expert_gate"],
                                          target_parameters=["gate.weight", *EXPERTS])}
    check_mixed_batch_matches_peft(model_dir, hf_model_cache(model_dir), paths,
                                   ["all", None, "experts", "all", "experts", None], PROMPTS, 12)


@pytest.mark.parametrize("arch,names,block", [("mixtral", ("w1", "w3", "w2"), "block_sparse_moe"),
                                              ("mixtral", ("w2",), "block_sparse_moe"),
                                              ("qwen3_moe", ("gate_proj", "up_proj", "down_proj"), "mlp"),
                                              ("olmoe", ("gate_proj", "up_proj", "down_proj"), "mlp")])
def test_an_adapter_in_transformers_4s_layout_serves_as_peft_converts_it(model_factory, hf_model_cache, tmp_path,
                                                                          arch, names, block):
    """One LoRA per expert module (and Mixtral's router as ``block_sparse_moe.gate``), as PEFT wrote adapters before
    transformers 5 fused the experts: read as PEFT 0.21 converts them on loading (gate and up at twice the rank,
    their B block-diagonal) and served as PEFT serves them, in a batch with the base model. (Not gate and up without
    down: PEFT 0.21 then loads neither, seen on OLMoE and Qwen3-MoE: its converter names the fused wrapper
    ``base_layer`` whether or not another wraps it; ``test_transformers_4s_experts_convert_to_the_same_updates``.)"""
    from peft_helpers import make_v4_expert_adapter
    model_dir = model_factory(arch)
    path = make_v4_expert_adapter(model_dir, tmp_path / "v4", names, block, router=arch == "mixtral")
    check_mixed_batch_matches_peft(model_dir, hf_model_cache(model_dir), {"v4": path},
                                   ["v4", None, "v4", "v4", None, "v4"], PROMPTS, 12)
    # trained on (a start adapter, a resumed job): the same experts' LoRA as served, in PEFT's layout
    from coserve.peft.lora_adapter import load_lora_adapter
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    trainable = load_model_trainable(path, model)
    served = load_lora_adapter("v4", path, model.module_shapes(), model.cfg.num_layers, experts=model.expert_shapes())
    assert set(trainable.ea) == set(served.expert_a) and trainable.config.target_parameters
    for key, a in served.expert_a.items():
        assert torch.equal(trainable.ea[key], a) and torch.equal(trainable.eb[key], served.expert_b[key])


@pytest.mark.parametrize("names", [("w1", "w3", "w2"), ("w1", "w3"), ("w3",)])
def test_transformers_4s_experts_convert_to_the_same_updates(names):
    """Each expert's update ``B A`` of the fused gate/up is gate's over up's (zeros where one was not adapted), and
    down's is its own."""
    from coserve.peft.expert_lora import from_v4
    gen = torch.Generator().manual_seed(0)
    e, r, h, i = 3, 2, 8, 5
    shapes = {"w1": (h, i), "w3": (h, i), "w2": (i, h)}
    tensors = {(n, x, "A"): torch.randn(r, shapes[n][0], generator=gen) for n in names for x in range(e)}
    tensors.update({(n, x, "B"): torch.randn(shapes[n][1], r, generator=gen) for n in names for x in range(e)})
    out = from_v4(tensors, ("w1", "w3", "w2"), e, "here")
    for x in range(e):
        def update(n):
            return tensors[(n, x, "B")] @ tensors[(n, x, "A")] if n in names else torch.zeros(i, h)
        if "w1" in names or "w3" in names:
            a, b = out["experts.gate_up_proj"]
            assert torch.allclose(b[x] @ a[x], torch.cat([update("w1"), update("w3")]), atol=1e-6)
        if "w2" in names:
            a, b = out["experts.down_proj"]
            assert torch.allclose(b[x] @ a[x], update("w2"), atol=1e-6)
    with pytest.raises(ValueError, match=f"here: expert 2's {names[0]} has no lora_A"):
        from_v4({k: v for k, v in tensors.items() if k != (names[0], 2, "A")}, ("w1", "w3", "w2"), e, "here")


@pytest.mark.parametrize("remat,memory_target", [("cheap", 0.5), ("cheap", 1.0), ("all", 0.5)])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("peft", [LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
                                  LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"],
                                             target_parameters=["experts.down_proj"]), "ia3"],
                         ids=["all-linear", "down", "ia3"])
def test_the_executor_keeps_exactly_the_plans_bytes_on_a_mixture(model_factory, tmp_path, arch, peft, remat,
                                                                 memory_target):
    """The planner prices a mixture as its executors run it (``graph._mixture``): the router's float32 probabilities
    kept, every expert of a token's gate/up outputs together kept or recomputed, the experts' LoRA at ``k`` times the
    rank (PEFT's gate/up at twice it, with ``all-linear``; the router's as a dense module's), Qwen2-MoE's shared
    expert's adapters' own tensors alone (``all-linear`` there: the shared expert); ``memory_target`` 1.0 keeps the
    gate/up outputs."""
    import random

    from coserve.finetune.config import FinetuneConfig
    from coserve.finetune.job import Example, FinetuneJob
    from coserve.finetune.runner import run_job
    from coserve.peft.config import IA3Config
    from coserve.peft.trainable import TrainableIA3
    model = load_model(model_factory(arch), torch.float32, torch.device("cpu"))
    if peft == "ia3":
        shared = ["shared_expert.up_proj", "shared_expert_gate"] if arch == "qwen2_moe" else []
        bypass = TrainableIA3(IA3Config(target_modules=["k_proj", "o_proj", *shared], feedforward_modules=["o_proj"]),
                              model.module_shapes(), model.cfg.num_layers, model.device)
    else:
        bypass = TrainableLora(peft, model.module_shapes(), model.cfg.num_layers, model.device,
                               torch.Generator().manual_seed(0), experts=model.expert_shapes())
    rng = random.Random(0)
    examples = [Example(ids, ids[1:] + [-100]) for ids in ([rng.randrange(5, 200) for _ in range(20)]
                                                           for _ in range(2))]
    job = FinetuneJob(model, bypass, examples, FinetuneConfig(output_dir=str(tmp_path / "o"), batch_size=2,
                                                              max_steps=1, window_tokens=5, rematerialize=remat,
                                                              memory_target=memory_target))
    run_job(job, progress=False)
    assert job.kept_bytes_per_token == job.plan.model_kept_bytes_per_token
    kept = {k.name for k in job.plan.kept}
    assert ("moe.probs" in kept) == (remat == "cheap") and ("moe.gu" in kept) == (memory_target == 1.0)
