"""Mixtures of experts (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE and its shared expert, GLM-4.5 with its sigmoid router and
dense first layer; coserve/model/moe.py). HF parity of logits and greedy tokens runs in test_model_parity.py (all
five are in conftest's ARCHS), training against PEFT in
test_finetune_vs_peft.py. Here: a co-served job changes no inference logprob, finetuning windows (the pruned
backward, from the kept routing and experts' gate/up or recomputing them; every layer under autograd) match one
whole-sequence backward, the expert calls are padded to batch-invariant sizes, GLM-4.5's routing is its router's,
Qwen-MoE's dense layers run as HF's, and what coserve does not run is refused naming the field or module."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from coserve.finetune.pruned_layer import BASE_KEEPS, new_keeps
from coserve.model.config import ModelConfig, ModelConfigError
from coserve.model.create import build_config, shape_init
from coserve.model.loader import load_model
from coserve.model.moe import route
from coserve.model.tokenizer_builder import build_tokenizer, save_tokenizer
from coserve.peft.config import IA3Config, LoraConfig, for_model
from tests.test_batch_invariance import _logprobs, _prompts
from tests.test_coserving import _engine
from tests.test_cuda_architectures import _every_module_job
from tests.test_model_parity import _flat_logits
from window_helpers import check_windows_match_autograd, perturbed_bypass

MOES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "glm4_moe", "gpt_oss")


@pytest.mark.parametrize("arch", MOES)
def test_co_served_requests_get_the_same_logprobs_bit_for_bit(model_factory, tmp_path, arch):
    model_dir = model_factory(arch)
    prompts = _prompts(7)
    alone = _logprobs(_engine(model_dir), prompts)
    engine = _engine(model_dir)
    assert engine.batch_invariant and engine.executor.fuse_finetuning  # windows share the router's and experts' calls
    job = _every_module_job(engine, tmp_path / "job")
    engine.add_finetune_job(job)
    assert _logprobs(engine, prompts) == alone
    assert job.tokens_done > 0


@pytest.mark.parametrize("remat", ["cheap", "cheap:every", "cheap:none", "all"])
@pytest.mark.parametrize("arch", MOES)
@pytest.mark.parametrize("peft", [LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
                                  IA3Config(target_modules=["k_proj", "v_proj", "o_proj"],
                                            feedforward_modules=["o_proj"])],
                         ids=["lora-dropout", "ia3"])
def test_window_schedules_match_one_whole_sequence_backward(model_factory, arch, peft, remat):
    """``cheap:every`` keeps the experts' gate/up outputs (and attention's output); ``cheap:none`` the router's
    probabilities alone, the experts' gate/up recomputed from the input. 2e-5: LoRA with dropout on Qwen2-MoE gave
    1.02e-5 under every keep set alike, ``all`` (each layer by autograd) included: float32's floor here, not the
    pruned backward's."""
    model = load_model(model_factory(arch), torch.float32, torch.device("cpu"))
    first = model.cfg.dense_layers[-1] + 1 if model.cfg.dense_layers else 0  # GLM-4.5's first layer is dense
    every, none = new_keeps(model, 4, BASE_KEEPS)[first].base, new_keeps(model, 4, ())[first].base
    assert {"moe.probs", "moe.gu", "attn.o"} <= set(every) and not {"gate", "up"} & set(every)
    assert set(none) == {"moe.probs"}
    if first:  # a dense layer keeps its own MLP's gate and up, as wide as its MLP
        dense = new_keeps(model, 4, BASE_KEEPS)[0].base
        assert not {"moe.probs", "moe.gu"} & set(dense)
        assert dense["gate"].shape == dense["up"].shape == (4, model.cfg.dense_intermediate_size)
    bypass = perturbed_bypass(peft, model, seed=4)
    check_windows_match_autograd(model, bypass, 47, remat, (5, 1, 30, 11), [1, 3, 16, 47], seed=1, dropout_seed=2,
                                 tol=2e-5)


def test_each_experts_rows_run_in_a_call_of_batch_invariant_size(model_factory, monkeypatch):
    """An expert's call over one routed row (a decode step) runs over ``padded_rows(1)`` rows, as the dense matmuls'
    do: calls of fewer rows round otherwise on a CPU."""
    model = load_model(model_factory("mixtral"), torch.float32, torch.device("cpu"))
    calls = []
    linear = model.linear
    monkeypatch.setattr(model, "linear",
                        lambda x, w, *a, **k: calls.append((x.shape[0], w.shape)) or linear(x, w, *a, **k))
    layer = model.layers[0]
    h = torch.randn(1, model.cfg.hidden_size)
    from coserve.model.moe import moe_mlp
    moe_mlp(model.cfg, h, linear(h, layer.router), layer.expert_gate_up, layer.expert_down, model.linear, model.act,
            model.padded_rows)
    assert calls and all(rows == model.padded_rows(1) for rows, _ in calls)
    assert len(calls) == 2 * model.cfg.experts_per_token  # gate/up and down of each of the token's experts


def test_routing_renormalises_where_the_config_says():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    cfg = ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 4,
                                 "moe_intermediate_size": 4, "num_hidden_layers": 1, "num_attention_heads": 1,
                                 "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False})
    experts, weights = route(cfg, logits)
    probs = torch.softmax(logits, -1)
    assert experts.tolist() == [[0, 1]] and torch.allclose(weights, probs[:, :2])
    cfg.norm_topk_prob = True
    assert torch.allclose(route(cfg, logits)[1].sum(-1), torch.ones(1))


@pytest.mark.parametrize("groups,topk_groups,norm", [(1, 1, True), (2, 1, True), (4, 2, False), (4, 3, True)])
def test_glm_routing_is_its_routers(model_factory, groups, topk_groups, norm):
    """GLM-4.5's experts and weights from random logits, as ``Glm4MoeTopkRouter`` picks and weighs them: sigmoid
    scores plus a correction bias, the experts of the best groups (by their two best biased scores) alone, the weights
    the unbiased scores, renormalised where the config says, then scaled."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    raw = json.loads((model_factory("glm4_moe") / "config.json").read_text())
    raw.update(n_routed_experts=16, num_experts_per_tok=4, n_group=groups, topk_group=topk_groups, norm_topk_prob=norm,
               routed_scaling_factor=1.7)
    cfg = ModelConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(groups * 10 + topk_groups)
    hidden = torch.randn(64, 8, generator=gen)
    hf = Glm4MoeTopkRouter(type("C", (), {"num_experts_per_tok": 4, "num_local_experts": 16, "hidden_size": 8,
                                          "routed_scaling_factor": 1.7, "n_group": groups, "topk_group": topk_groups,
                                          "norm_topk_prob": norm})())
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 8, generator=gen))
        hf.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.3)
        logits, hf_weights, hf_experts = hf(hidden)
    experts, weights = route(cfg, logits, hf.e_score_correction_bias)
    order, hf_order = experts.sort(-1), hf_experts.sort(-1)  # HF's come unsorted; each token's set is what counts
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices),
                               atol=1e-6, rtol=1e-6)
    if topk_groups < groups:  # some token's experts changed by the groups: the test reaches the grouping
        ungrouped = route(ModelConfig.from_dict({**raw, "topk_group": groups}), logits, hf.e_score_correction_bias)
        assert not torch.equal(order.values, ungrouped[0].sort(-1).values)


def test_glm_45_airs_config_reads_as_transformers_reads_it():
    """The fields of GLM-4.5-Air's config.json (transformers 4.54's spelling): half of each 128-wide head rotated by
    theta 10^6, the first layer dense (10,944 wide), 128 experts of 1,408 and one shared expert, 8 a token by sigmoid
    scores in one group, q/k/v biases, no q/k norms; its multi-token prediction layer left out."""
    from transformers import Glm4MoeConfig
    raw = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
           "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
           "hidden_size": 4096, "partial_rotary_factor": 0.5, "intermediate_size": 10944,
           "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
           "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
           "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
           "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
           "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "use_qk_norm": False, "vocab_size": 151552}
    cfg = ModelConfig.from_dict(raw)
    hf = Glm4MoeConfig.from_dict(raw)
    assert cfg.rotary_dim == int(128 * hf.rope_parameters["partial_rotary_factor"]) == 64
    assert cfg.rope.theta == hf.rope_parameters["rope_theta"] == 1e6
    assert cfg.dense_layers == tuple(range(hf.first_k_dense_replace)) == (0,)
    assert (cfg.dense_intermediate_size, cfg.intermediate_size, cfg.shared_expert_size) == (10944, 1408, 1408)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.router, cfg.expert_groups) == (128, 8, "sigmoid", 1)
    assert cfg.qkv_bias and not cfg.qk_norm and not cfg.shared_expert_gated and cfg.num_layers == 46
    assert cfg.eos_token_ids == [151329, 151336, 151338]


def _hf_written(path, arch: str, **fields):
    """A tiny ``arch`` model written by transformers with ``fields`` set on its config (new weights)."""
    cfg = build_config("tiny", arch)
    for name, value in fields.items():
        setattr(cfg, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    shape_init(model)
    model.save_pretrained(str(path))
    save_tokenizer(build_tokenizer(cfg.vocab_size), path, model_max_length=cfg.max_position_embeddings)
    return path


@pytest.mark.parametrize("arch,fields,dense", [("qwen3_moe", {"mlp_only_layers": [1]}, (1,)),
                                                ("qwen2_moe", {"decoder_sparse_step": 2}, (0,))])
def test_qwen_moes_dense_layers_run_as_hfs(tmp_path, arch, fields, dense):
    """Qwen-MoE's layers with a dense MLP (``mlp_only_layers``, and those ``decoder_sparse_step`` skips) run it, as
    HF's: the same logits."""
    path = _hf_written(tmp_path / "model", arch, **fields)
    assert ModelConfig.from_dir(path).dense_layers == dense
    ids = [[5, 17, 300, 41, 9, 2200, 77], [3, 1000]]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for seq, got in zip(ids, _flat_logits(path, ids)):
        with torch.inference_mode():
            torch.testing.assert_close(got, hf(torch.tensor([seq])).logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,field,value,message", [
    ("qwen3_moe", "mlp_only_layers", [2], "field 'mlp_only_layers': must list layers 0 to 1"),
    ("qwen3_moe", "decoder_sparse_step", 0, "field 'decoder_sparse_step': must be positive"),
    ("qwen3_moe", "use_sliding_window", True, "field 'use_sliding_window'"),
    ("qwen3_moe", "num_experts_per_tok", 9, "num_experts_per_tok must be 1 to 4"),
    ("glm4_moe", "n_group", 3, "n_group 3 does not divide the 8 experts"),
    ("glm4_moe", "n_group", 8, "topk_group 1 of n_group 8 leaves fewer than num_experts_per_tok"),
    ("glm4_moe", "first_k_dense_replace", 3, "field 'first_k_dense_replace': must be 0 to 2"),
])
def test_what_is_not_run_is_refused_naming_the_field(model_factory, arch, field, value, message):
    raw = json.loads((model_factory(arch) / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict({**raw, field: value})


@pytest.mark.parametrize("arch", MOES)
def test_a_mixtures_modules_are_its_attention_and_its_router(model_factory, arch):
    """A mixture's adaptable modules are its attention's and its router's (``gate``, PEFT's name; not gpt-oss's, no
    module PEFT adapts), and Qwen2-MoE's shared expert's; its experts are parameters (PEFT's ``target_parameters``,
    test_expert_lora.py). A module it lacks is refused naming what it has."""
    modules = load_model(model_factory(arch), torch.float32, torch.device("cpu")).module_shapes()
    shared = {"shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate"}
    router = set() if arch == "gpt_oss" else {"gate"}
    shared = shared if arch == "qwen2_moe" else set()
    assert set(modules) == {"q_proj", "k_proj", "v_proj", "o_proj"} | router | shared
    with pytest.raises(ValueError, match=r"\['gate_up_proj'\] are not modules of this model, which has q_proj"):
        for_model(LoraConfig(target_modules=["q_proj", "gate_up_proj"]), modules)


def test_a_job_naming_no_modules_gets_pefts_default_for_the_model(model_factory, tmp_path):
    """With no modules named (the OpenAI API's jobs, ``coserve finetune`` without ``--target-modules``, ``LLM.finetune``
    without ``peft``), a mixture's adapter goes where PEFT's default puts Mixtral's within the attention (LoRA on q/v,
    IA3 on k/v), not on the down_proj it has none of; a dense model keeps coserve's defaults. The adapter serves."""
    from coserve import LLM, FinetuneConfig, SamplingParams
    from coserve.peft.config import default_targets
    from tests.test_llm_finetune import _data
    dense = load_model(model_factory("llama"), torch.float32, torch.device("cpu")).module_shapes()
    moe = load_model(model_factory("mixtral"), torch.float32, torch.device("cpu")).module_shapes()
    assert default_targets("lora", dense) == {} and default_targets("ia3", dense) == {}
    assert default_targets("lora", moe) == {"target_modules": ["q_proj", "v_proj"]}
    assert for_model(IA3Config(**default_targets("ia3", moe)), moe).target_modules == ["k_proj", "v_proj"]
    llm = LLM(model_factory("mixtral"), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    job = llm.finetune(_data(tmp_path / "d.jsonl"), config=FinetuneConfig(output_dir=str(tmp_path / "out"),
                                                                        max_steps=2, batch_size=2, lr=5e-2))
    assert job.wait(timeout=120)["status"] == "succeeded"
    assert json.loads((job.output_dir / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
    llm.load_adapter("tuned", job.output_dir)
    assert len(llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0), adapter="tuned")[0].token_ids)


def test_an_openai_fine_tuning_job_on_a_mixture_serves_its_model(model_factory, tmp_path):
    """Through a live server and the ``openai`` client: a job naming only the experts' down projection (PEFT's
    ``target_parameters``) on a Mixtral succeeds (LoRA on q/v too, PEFT's default modules there), its model chats and
    differs from the base; so does one naming the experts' gate and up by transformers 4's names (w1, w3: gate/up at
    twice the rank); an expert as a target module is a 400 naming the modules the model has, and IA3 of the experts a
    400 naming the field."""
    import io

    from openai import BadRequestError, OpenAI
    from server_helpers import chat_jsonl, start_server, wait_for_job
    srv = start_server(model_factory("mixtral"), tmp_path / "state", "--served-model-name", "tiny-mixtral")
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        f = client.files.create(file=("train.jsonl", io.BytesIO(chat_jsonl())), purpose="fine-tune")
        with pytest.raises(BadRequestError, match=r"\['down_proj'\] are not modules of this model, which has q_proj"):
            client.fine_tuning.jobs.create(model="tiny-mixtral", training_file=f.id,
                                           extra_body={"coserve": {"target_modules": ["down_proj"]}})
        with pytest.raises(BadRequestError, match=r"coserve.target_parameters: only LoRA adapts experts"):
            client.fine_tuning.jobs.create(model="tiny-mixtral", training_file=f.id, extra_body={
                "coserve": {"peft": "ia3", "target_parameters": ["experts.down_proj"]}})
        job = client.fine_tuning.jobs.create(model="tiny-mixtral", training_file=f.id, seed=1,
                                             hyperparameters={"n_epochs": 1, "learning_rate_multiplier": 100},
                                             extra_body={"coserve": {"target_parameters": ["experts.down_proj"]}})
        done = wait_for_job(client, job.id)
        assert done.status == "succeeded", done.error
        saved = json.loads(next((tmp_path / "state").rglob("adapter_config.json")).read_text())
        assert saved["target_modules"] == ["q_proj", "v_proj"] and saved["target_parameters"] == ["experts.down_proj"]
        # transformers 4's names of Mixtral's experts, as PEFT reads them: w1 and w3, gate/up at twice the rank
        job = client.fine_tuning.jobs.create(model="tiny-mixtral", training_file=f.id, seed=1, extra_body={
            "coserve": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "w1", "w3"], "max_steps": 1}})
        other = wait_for_job(client, job.id)
        assert other.status == "succeeded", other.error
        hi = [{"role": "user", "content": "Hi"}]
        assert client.chat.completions.create(model=other.fine_tuned_model, messages=hi, max_tokens=2).choices
        hello = [{"role": "user", "content": "Hello"}]
        kwargs = {"messages": hello, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
        tuned = client.chat.completions.create(model=done.fine_tuned_model, **kwargs).choices[0].message.content
        assert tuned != client.chat.completions.create(model="tiny-mixtral", **kwargs).choices[0].message.content
    finally:
        srv.stop()


def test_expert_groups_are_each_experts_rows_in_order():
    """One sort and one transfer of counts find what ``torch.where(experts == e)`` finds for each expert picked."""
    from coserve.model.moe import expert_groups
    experts = torch.tensor([[2, 0], [0, 3], [3, 2], [2, 0], [1, 0]])
    groups = expert_groups(experts, 5)
    assert [e for e, _, _ in groups] == [0, 1, 2, 3]  # expert 4 picked by none
    for e, rows, slot in groups:
        want_rows, want_slot = torch.where(experts == e)
        assert rows.tolist() == want_rows.tolist() and slot.tolist() == want_slot.tolist()


def test_the_shared_experts_gate_rounds_each_row_as_it_would_alone():
    """Qwen2-MoE's ``sigmoid(h @ g)`` over a column of rows: ``torch.sigmoid`` there rounds some rows otherwise by the
    row count (seen on this CPU from 57 rows on: a co-served window's rows would change an inference row's bits);
    ``elementwise_sigmoid`` (the softmax of ``[x, 0]``, computed row by row) does not, and stays within 1e-7 of it."""
    from coserve.model.row_invariant import elementwise_sigmoid
    torch.manual_seed(0)
    x = torch.randn(1500, 1) * 3
    whole = elementwise_sigmoid(x)
    assert all(torch.equal(elementwise_sigmoid(x[:n]), whole[:n]) for n in range(1, 1500, 13))
    assert torch.allclose(whole, torch.sigmoid(x), atol=1e-7, rtol=0)
