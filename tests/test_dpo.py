"""DPO (``method="dpo"``): preference data in OpenAI's and TRL's formats, and the job's gradients, losses and adapter
against one plain autograd DPO step (reference log-probabilities from the base model), in any window schedule and
co-served with inference."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from coserve import LLM, FinetuneConfig, LoraConfig, SamplingParams
from coserve.finetune.build import load_training, new_job
from coserve.finetune.dataset import DatasetError
from coserve.finetune.preference import encode_preference_record
from coserve.finetune.preference_job import NO_BYPASS, PreferenceJob, dpo_terms
from coserve.finetune.reference import whole_sequence_loss
from coserve.finetune.runner import WindowSizes
from coserve.finetune.sequence_state import IGNORE_INDEX
from coserve.model.loader import load_model
from coserve.model.tokenizer import load_tokenizer
from coserve.peft.config import IA3Config
from coserve.peft.trainable import TrainableIA3, TrainableLora

WORDS = ["cats", "dogs", "birds", "fish", "owls", "bees"]


def _openai(word: str) -> dict:
    return {"input": {"messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": f"Tell me about {word}."}]},
            "preferred_output": [{"role": "assistant", "content": f"{word.title()} are wonderful animals."}],
            "non_preferred_output": [{"role": "assistant", "content": "No."}]}


def _write(path, records) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def _bypass(model, kind: str, seed: int = 0):
    """A bypass away from its initialisation, so that the policy differs from the reference."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "ia3":
        bypass = TrainableIA3(IA3Config(), model.module_shapes(), model.cfg.num_layers, model.device)
        with torch.no_grad():
            for p in bypass.parameters():
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        return bypass
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    bypass = TrainableLora(cfg, model.module_shapes(), model.cfg.num_layers, model.device, gen)
    with torch.no_grad():
        for p in bypass.parameters():
            if p.shape[1] == cfg.r:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return bypass


def _trl_loss(z: torch.Tensor, beta: float, loss_type: str = "sigmoid", eps: float = 0.0) -> torch.Tensor:
    """TRL's DPOTrainer losses of the log-ratio difference ``z``."""
    if loss_type == "hinge":
        return torch.relu(1 - beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    return -F.logsigmoid(beta * z) * (1 - eps) - F.logsigmoid(-beta * z) * eps


def _oracle(model, bypass, pairs, beta: float, loss_type: str = "sigmoid", eps: float = 0.0, reference=NO_BYPASS
            ) -> tuple[float, list[torch.Tensor]]:
    """The mean DPO loss of ``pairs`` and its gradients, by one plain autograd backward (IPO on per-token means)."""
    losses = []
    for pair in pairs:
        logps = []
        for ex in (pair.chosen, pair.rejected):
            logp = -whole_sequence_loss(model, bypass, ex.token_ids, ex.targets, dropout_seed=None)
            with torch.no_grad():
                ref = -whole_sequence_loss(model, reference, ex.token_ids, ex.targets, dropout_seed=None)
            n = sum(t != IGNORE_INDEX for t in ex.targets) if loss_type == "ipo" else 1
            logps.append((logp - ref) / n)
        losses.append(_trl_loss(logps[0] - logps[1], beta, loss_type, eps))
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in bypass.parameters()]
    bypass.zero_grad()
    return float(loss), grads


@pytest.mark.parametrize("kind, schedule, loss_type, eps, beta", [
    ("lora", "", "sigmoid", 0.0, 0.5), ("lora", "random:5", "sigmoid", 0.0, 0.5),
    ("ia3", "random:9", "sigmoid", 0.0, 0.5),
    ("lora", "random:2", "sigmoid", 0.2, 0.5), ("lora", "random:4", "hinge", 0.0, 0.02),
    ("lora", "random:6", "ipo", 0.0, 0.5)])
def test_a_dpo_step_matches_plain_autograd(model_factory, tmp_path, kind, schedule, loss_type, eps, beta):
    model_dir = model_factory("llama")
    model, tokenizer = load_model(model_dir, torch.float32, torch.device("cpu")), load_tokenizer(model_dir)
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), method="dpo", dpo_beta=beta, batch_size=2, grad_accum=2,
                         max_steps=1, shuffle=False, window_schedule=schedule, lr=1e-3,
                         max_grad_norm=0, dpo_loss=loss_type, dpo_label_smoothing=eps)
    pairs, report = load_training(_write(tmp_path / "p.jsonl", [_openai(w) for w in WORDS[:4]]), tokenizer, cfg)
    assert report.num_examples == 4
    bypass = _bypass(model, kind)
    want_loss, want = _oracle(model, bypass, pairs, cfg.dpo_beta, loss_type, eps)
    assert max(float(w.abs().max()) for w in want) > 0  # (a hinge past every pair's margin would have none)
    job = new_job(model, bypass, pairs, cfg)
    assert isinstance(job, PreferenceJob) and job.total_steps == 1 and job.held_tokens == max(
        len(p.chosen.token_ids) + len(p.rejected.token_ids) for p in pairs)
    got = []
    job.optimizer.step = lambda: got.extend(p.grad.detach().clone() for p in bypass.parameters())
    sizes = WindowSizes(cfg)
    while (kind_ := job.next_work()) is not None:
        (job.forward if kind_ == "forward" else job.backward)(sizes.next(job.pending_tokens()))
    assert job.log[0].loss == pytest.approx(want_loss, rel=1e-5)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6 * float(w.abs().max())), float((g - w).abs().max())
    assert 0 <= job.log[0].reward_accuracy <= 1
    line = json.loads((tmp_path / "out" / "training_log.jsonl").read_text().splitlines()[0])
    assert line["reward_margin"] == pytest.approx(job.log[0].reward_margin) and "reward_accuracy" in line


def _reference_free_oracle(model, bypass, pairs, cfg: FinetuneConfig) -> tuple[float, list[torch.Tensor]]:
    """SimPO's (TRL's CPOTrainer, loss_type simpo, cpo_alpha 0) or ORPO's (TRL's ORPOTrainer) loss of ``pairs`` and
    its gradients, by one plain autograd backward."""
    beta, logps, counts = cfg.dpo_beta, [], []
    for pair in pairs:
        for ex in (pair.chosen, pair.rejected):
            logps.append(-whole_sequence_loss(model, bypass, ex.token_ids, ex.targets, dropout_seed=None))
            counts.append(sum(t != IGNORE_INDEX for t in ex.targets))
    means = [lp / n for lp, n in zip(logps, counts)]
    chosen, rejected = torch.stack(means[0::2]), torch.stack(means[1::2])
    if cfg.method == "simpo":
        z, eps = beta * (chosen - rejected) - cfg.simpo_gamma, cfg.dpo_label_smoothing
        loss = (-F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps).mean()
    else:
        nll = -torch.stack(logps[0::2]).sum() / sum(counts[0::2])
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        loss = nll - beta * F.logsigmoid(log_odds).mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in bypass.parameters()]
    bypass.zero_grad()
    return float(loss), grads


@pytest.mark.parametrize("method, kind, schedule, eps, beta", [
    ("simpo", "lora", "random:3", 0.0, 2.0), ("simpo", "ia3", "random:7", 0.1, 2.0),
    ("orpo", "lora", "random:3", 0.0, 0.5), ("orpo", "ia3", "", 0.0, 0.5)])
def test_reference_free_steps_match_plain_autograd(model_factory, tmp_path, method, kind, schedule, eps, beta):
    """SimPO and ORPO: no reference forwards; an optimizer step's gradients (batch_size 2, grad_accum 2) and loss
    equal the plain autograd oracle's in any window schedule."""
    model_dir = model_factory("llama")
    model, tokenizer = load_model(model_dir, torch.float32, torch.device("cpu")), load_tokenizer(model_dir)
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), method=method, dpo_beta=beta, batch_size=2, grad_accum=2,
                         max_steps=1, shuffle=False, window_schedule=schedule, lr=1e-3, max_grad_norm=0,
                         dpo_label_smoothing=eps, simpo_gamma=0.3)
    pairs, _ = load_training(_write(tmp_path / "p.jsonl", [_openai(w) for w in WORDS[:4]]), tokenizer, cfg)
    bypass = _bypass(model, kind)
    want_loss, want = _reference_free_oracle(model, bypass, pairs, cfg)
    job = new_job(model, bypass, pairs, cfg)
    got = []
    job.optimizer.step = lambda: got.extend(p.grad.detach().clone() for p in bypass.parameters())
    sizes, forwards = WindowSizes(cfg), 0
    while (kind_ := job.next_work()) is not None:
        forwards += kind_ == "forward"
        (job.forward if kind_ == "forward" else job.backward)(sizes.next(job.pending_tokens()))
    assert job._refs[False] == {} and job.reference is NO_BYPASS  # no reference forward ran
    assert job.log[0].loss == pytest.approx(want_loss, rel=1e-5)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6 * float(w.abs().max())), float((g - w).abs().max())
    assert 0 <= job.log[0].reward_accuracy <= 1


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "orpo", "dpo_label_smoothing": 0.1}, "^dpo_label_smoothing: ORPO's"),
    ({"method": "simpo", "dpo_loss": "ipo"}, "^dpo_loss: ipo is a DPO loss"),
    ({"method": "simpo", "simpo_gamma": -1}, "^simpo_gamma: must be a non-negative number"),
    ({"method": "orpo", "dpo_reference": "x"}, "^dpo_reference: a reference adapter is for method dpo"),
    ({"method": "simpo", "train_on_prompt": True}, "^train_on_prompt: simpo compares")])
def test_bad_reference_free_configs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FinetuneConfig(output_dir="o", **kwargs)


def test_dpo_trains_toward_the_preferred_completions_and_keeps_the_reference(model_factory, tmp_path):
    model_dir = model_factory("llama")
    model, tokenizer = load_model(model_dir, torch.float32, torch.device("cpu")), load_tokenizer(model_dir)
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), method="dpo", batch_size=2, epochs=4, lr=2e-2)
    pairs, _ = load_training(_write(tmp_path / "p.jsonl", [_openai(w) for w in WORDS[:4]]), tokenizer, cfg)
    bypass = TrainableLora(LoraConfig(r=4, lora_alpha=8), model.module_shapes(), model.cfg.num_layers, model.device,
                           torch.Generator().manual_seed(0))
    job = new_job(model, bypass, pairs, cfg)
    references = []
    made = job._sequence
    job._sequence = lambda ex: (references.append(1) if job._role.startswith("ref_") else None) or made(ex)
    sizes = WindowSizes(cfg)
    while (kind := job.next_work()) is not None:
        (job.forward if kind == "forward" else job.backward)(sizes.next(job.pending_tokens()))
    assert len(references) == 2 * len(pairs)  # each pair's reference once: later epochs reuse them
    assert job.log[0].loss == pytest.approx(math.log(2), abs=1e-6)  # B = 0: the policy is the reference
    assert job.log[-1].loss < 0.5 * math.log(2) and job.log[-1].reward_accuracy == 1.0


def test_a_co_served_dpo_job_trains_the_adapter_of_the_job_alone(model_factory, tmp_path):
    model_dir = model_factory("llama")
    data = _write(tmp_path / "p.jsonl", [_openai(w) for w in WORDS])
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "down_proj"])

    def config(name):
        return FinetuneConfig(output_dir=str(tmp_path / name), method="dpo", batch_size=2, max_steps=3, lr=1e-2,
                              seed=3)

    alone = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    assert alone.finetune(data, peft, config("alone")).wait(timeout=120)["status"] == "succeeded"
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=128, block_size=4, max_num_batched_tokens=24)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    before = llm.generate([[5, 6, 7, 8], [9, 10, 11]], params)
    job = llm.finetune(data, peft, config("coserved"))
    during = llm.generate([[5, 6, 7, 8], [9, 10, 11]] * 2, params)  # windows share these iterations
    assert job.wait(timeout=120)["status"] == "succeeded"
    assert [o.token_ids for o in during] == [o.token_ids for o in before] * 2
    from safetensors.torch import load_file
    a, b = (load_file(str(tmp_path / n / "adapter_model.safetensors")) for n in ("alone", "coserved"))
    assert a.keys() == b.keys()
    for key in a:  # the measure (relative error), as the supervised co-serving tests take it: element by
        # element (atol 1e-7) this failed once in a whole-suite run on a loaded machine, never alone; the cause is
        # not established (window schedules alone give the DPO job the same bits)
        assert (a[key] - b[key]).norm() / b[key].norm() <= 1e-5, key


def test_preference_records_in_each_format(model_factory):
    tokenizer = load_tokenizer(model_factory("llama"))
    pair, _ = encode_preference_record(_openai("cats"), tokenizer, 256)
    prompt = tokenizer.apply_chat_template(_openai("cats")["input"]["messages"], tokenize=False,
                                           add_generation_prompt=True)
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    for ex, text in ((pair.chosen, "Cats are wonderful animals."), (pair.rejected, "No.")):
        loss_ids = [t for t in ex.targets if t != IGNORE_INDEX]
        assert all(t == IGNORE_INDEX for t in ex.targets[:n - 1])  # no loss on the prompt
        assert tokenizer.decode(loss_ids, skip_special_tokens=True) == text
    trl = {"prompt": _openai("cats")["input"]["messages"], "chosen": _openai("cats")["preferred_output"],
           "rejected": _openai("cats")["non_preferred_output"]}
    assert encode_preference_record(trl, tokenizer, 256)[0] == pair
    plain, _ = encode_preference_record({"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}, tokenizer, 256)
    prompt_ids = tokenizer("Q: 2+2?\nA:")["input_ids"]
    assert plain.chosen.token_ids == prompt_ids + tokenizer(" 4", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id]
    assert [t for t in plain.rejected.targets if t != IGNORE_INDEX] == tokenizer(
        " 5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


@pytest.mark.parametrize("record, message", [
    ({"input": {"messages": [{"role": "user", "content": "x"}]}, "preferred_output": [],
      "non_preferred_output": [{"role": "assistant", "content": "y"}]},
     "preferred_output: expected an array of one assistant message, got 0 messages"),
    ({"input": {"messages": [{"role": "robot", "content": "x"}]},
      "preferred_output": [{"role": "assistant", "content": "y"}],
      "non_preferred_output": [{"role": "assistant", "content": "z"}]},
     "input.messages[0].role: 'robot' is not one of system, user, assistant"),
    ({"input": "x", "preferred_output": [], "non_preferred_output": []}, "input: expected an object with messages"),
    ({"input": {"messages": [{"role": "user", "content": "x"}]},
      "preferred_output": [{"role": "user", "content": "y"}],
      "non_preferred_output": [{"role": "assistant", "content": "z"}]},
     "preferred_output[0].role: expected 'assistant', got 'user'"),
    ({"prompt": "x", "chosen": 5, "rejected": "z"}, "chosen: expected a string, got number"),
    ({"prompt": "x", "chosen": "y"}, "record: no 'input'"),
])
def test_bad_preference_records_name_their_field(model_factory, record, message):
    with pytest.raises(ValueError) as e:
        encode_preference_record(record, load_tokenizer(model_factory("llama")), 256)
    assert str(e.value).startswith(message), str(e.value)


def test_a_preference_file_reports_bad_lines_and_bad_configs_are_refused(model_factory, tmp_path):
    model_dir = model_factory("llama")
    tokenizer = load_tokenizer(model_dir)
    cfg = FinetuneConfig(output_dir=str(tmp_path / "o"), method="dpo")
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(_openai("cats")) + "\nnot json\n" + json.dumps({"text": "sft"}) + "\n")
    pairs, report = load_training(path, tokenizer, cfg)
    assert len(pairs) == 1 and [n for n, _ in report.malformed] == [2, 3]
    with pytest.raises(DatasetError, match="no valid training example"):
        load_training(_write(tmp_path / "sft.jsonl", [{"text": "hello"}]), tokenizer, cfg)
    for kwargs, field in (({"method": "ppo"}, "method"), ({"method": "dpo", "dpo_beta": 0}, "dpo_beta"),
                          ({"method": "dpo", "train_on_prompt": True}, "train_on_prompt")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            FinetuneConfig(output_dir="o", **kwargs)
    loss, margin, slope = dpo_terms(0.1, -10.0, -12.0, -11.0, -11.0)  # chosen gained 1, rejected lost 1
    assert margin == pytest.approx(0.2) and loss == pytest.approx(-math.log(1 / (1 + math.exp(-0.2))))
    assert slope == pytest.approx(-0.1 / (1 + math.exp(0.2)))
    assert dpo_terms(1.0, 0.0, 2000.0, 0.0, 0.0)[0] == pytest.approx(2000.0)  # no overflow either way
    assert dpo_terms(1.0, 2000.0, 0.0, 0.0, 0.0)[2] == 0.0 and dpo_terms(1.0, 0.0, 2000.0, 0.0, 0.0)[2] == -1.0
    assert dpo_terms(0.5, 3.0, 0.0, 0.0, 0.0, "hinge")[::2] == (0.0, 0.0)  # past the hinge: no loss, no gradient
    assert dpo_terms(0.5, 1.0, 0.0, 0.0, 0.0, "hinge")[::2] == (0.5, -0.5)
    assert dpo_terms(0.5, 1.0, 0.0, 0.0, 0.0, "ipo")[::2] == (0.0, 0.0)  # z = 1 / (2 beta): IPO's target
    for kwargs, field in (({"dpo_loss": "kto"}, "dpo_loss"), ({"dpo_label_smoothing": 0.5}, "dpo_label_smoothing"),
                          ({"dpo_loss": "ipo", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            FinetuneConfig(output_dir="o", method="dpo", **kwargs)


def test_the_cli_trains_a_dpo_adapter_that_peft_loads(model_factory, tmp_path, capsys):
    from coserve.cli import main
    from peft_helpers import peft_model
    model_dir = model_factory("qwen2")
    data = _write(tmp_path / "p.jsonl", [_openai(w) for w in WORDS[:3]]
                  + [{"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}])
    out = tmp_path / "adapter"
    assert main(["finetune", "--model", str(model_dir), "--data", data, "--output", str(out), "--method", "dpo",
                 "--dpo-beta", "0.2", "--dpo-loss", "ipo", "--max-steps", "2", "--batch-size", "2", "--lora-r", "4",
                 "--lr", "0.05",
                 "--memory-report", str(tmp_path / "mem.json"), "--no-progress"]) == 0
    assert "4 examples" in capsys.readouterr().out
    log = [json.loads(x) for x in (out / "training_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2] and all("reward_margin" in x for x in log)
    peft_model(model_dir, out)  # a PEFT adapter directory
    assert json.loads((tmp_path / "mem.json").read_text())["kept_bytes_per_token"] > 0
    assert main(["finetune", "--model", str(model_dir), "--data", data, "--output", str(tmp_path / "o2"),
                 "--method", "simpo", "--simpo-gamma", "0.2", "--validation-data", data, "--max-steps", "1",
                 "--no-progress"]) == 0
    assert "validation: 4 examples" in capsys.readouterr().out
    line = json.loads((tmp_path / "o2" / "training_log.jsonl").read_text())
    assert line["valid_loss"] > 0 and 0 <= line["valid_mean_token_accuracy"] <= 1
    config = json.loads((tmp_path / "o2" / "training_state.json").read_text())["config"]
    assert (config["method"], config["simpo_gamma"]) == ("simpo", 0.2)


def _peft_preference(model_dir, adapter_dir, pairs, cfg: FinetuneConfig, steps: int):
    """HF PEFT trained as TRL's trainers compute the loss: DPOTrainer without a reference model (the reference is the
    adapter disabled), CPOTrainer's SimPO (per-token means, a margin gamma) and ORPOTrainer (the chosen completions'
    token-mean cross-entropy minus beta times the log-sigmoid of the means' log odds ratio)."""
    from peft_helpers import PeftTraining
    peft = PeftTraining(model_dir, adapter_dir, cfg, steps)

    def logp(ex):
        logits = peft.model(input_ids=torch.tensor([ex.token_ids])).logits[0]
        return -F.cross_entropy(logits, torch.tensor(ex.targets), ignore_index=IGNORE_INDEX, reduction="sum")

    def tokens(ex):
        return sum(t != IGNORE_INDEX for t in ex.targets)

    losses, beta = [], cfg.dpo_beta
    for step in range(steps):
        batch = pairs[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        loss = 0
        if cfg.method == "orpo":
            loss = -sum(logp(pair.chosen) for pair in batch) / sum(tokens(pair.chosen) for pair in batch)
        for pair in batch:
            chosen, rejected = logp(pair.chosen), logp(pair.rejected)
            if cfg.method == "dpo":
                with torch.no_grad(), peft.model.disable_adapter():
                    refs = [logp(pair.chosen), logp(pair.rejected)]
                loss = loss - F.logsigmoid(beta * ((chosen - refs[0]) - (rejected - refs[1]))) / len(batch)
                continue
            chosen, rejected = chosen / tokens(pair.chosen), rejected / tokens(pair.rejected)
            if cfg.method == "simpo":
                loss = loss - F.logsigmoid(beta * (chosen - rejected) - cfg.simpo_gamma) / len(batch)
            else:
                log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
                loss = loss - beta * F.logsigmoid(log_odds) / len(batch)
        losses.append(peft.step(loss))
    return losses, peft.state()


@pytest.mark.parametrize("method, beta", [("dpo", 0.3), ("simpo", 2.0), ("orpo", 0.5)])
def test_preference_training_matches_hf_peft(model_factory, tmp_path, method, beta):
    from coserve.finetune.runner import run_job
    from coserve.peft.trainable import load_trainable
    from peft_helpers import make_lora_adapter
    model_dir = model_factory("llama")
    start = make_lora_adapter(model_dir, tmp_path / "start", seed=3, r=4, lora_alpha=8,
                              target_modules=["q_proj", "v_proj", "down_proj"])
    model, tokenizer = load_model(model_dir, torch.float32, torch.device("cpu")), load_tokenizer(model_dir)
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), method=method, dpo_beta=beta, batch_size=2, lr=0.01,
                         warmup_steps=1, weight_decay=0.01, shuffle=False, window_schedule="random:11")
    pairs, _ = load_training(_write(tmp_path / "p.jsonl", [_openai(w) for w in WORDS]), tokenizer, cfg)
    bypass = load_trainable(start, model.module_shapes(), model.cfg.num_layers, model.device, model.module_weight)
    job = new_job(model, bypass, pairs, cfg)
    run_job(job, progress=False)
    ref_losses, ref_state = _peft_preference(model_dir, start, pairs, cfg, 3)
    assert [r.loss for r in job.log] == pytest.approx(ref_losses, abs=1e-5)
    ours = bypass.state_dict()
    assert set(ours) == set(ref_state)
    for name, ref in ref_state.items():
        assert float((ours[name] - ref).norm() / ref.norm()) <= 1e-4, name


def test_a_resumed_dpo_job_continues_exactly(model_factory, tmp_path):
    from coserve.finetune.runner import run_job
    from coserve.peft.trainable import load_trainable
    model_dir = model_factory("llama")
    model, tokenizer = load_model(model_dir, torch.float32, torch.device("cpu")), load_tokenizer(model_dir)

    def cfg(out):
        return FinetuneConfig(output_dir=str(tmp_path / out), method="dpo", batch_size=2, max_steps=4, lr=1e-2,
                              seed=3, window_tokens=7, lr_scheduler="cosine", warmup_steps=1)

    pairs, _ = load_training(_write(tmp_path / "p.jsonl", [_openai(w) for w in WORDS]), tokenizer, cfg("x"))

    def bypass():
        return _bypass(model, "lora")

    whole = bypass()
    uninterrupted = new_job(model, whole, pairs, cfg("whole"))
    run_job(uninterrupted, progress=False)
    half = new_job(model, bypass(), pairs, cfg("half"))
    while half.step < 2:
        kind = half.next_work()
        (half.forward if kind == "forward" else half.backward)(7)
    half.forward(7)  # into step 3's first pair: a checkpoint now is still step 2's
    half.save()
    resumed_bypass = load_trainable(tmp_path / "half", model.module_shapes(), model.cfg.num_layers, model.device)
    resumed = new_job(model, resumed_bypass, pairs, cfg("rest"), resume_from=tmp_path / "half")
    assert resumed.step == 2
    assert resumed._refs[False] == half._refs[False] and len(half._refs[False]) >= 4  # the checkpoint kept them
    run_job(resumed, progress=False)
    assert [r.loss for r in resumed.log] == pytest.approx([r.loss for r in uninterrupted.log[2:]], rel=1e-5)
    for name, tensor in whole.state_dict().items():
        torch.testing.assert_close(resumed_bypass.state_dict()[name], tensor, rtol=1e-5, atol=1e-7)
    # other pairs, or another reference, and the saved log-probabilities are not theirs: they run again
    other = new_job(model, _bypass(model, "lora"), pairs[1:] + pairs[:1], cfg("other"), resume_from=tmp_path / "half")
    assert other._refs[False] == {}
    from peft_helpers import make_lora_adapter
    sft = make_lora_adapter(model_dir, tmp_path / "sft", seed=2, r=4, target_modules=["down_proj"])
    with_ref = FinetuneConfig(**{**{k: getattr(cfg("ref"), k) for k in cfg("ref").__slots__},
                                 "dpo_reference": str(sft)})
    assert new_job(model, _bypass(model, "lora"), pairs, with_ref, resume_from=tmp_path / "half")._refs[False] == {}


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_validation_pairs_give_the_mean_loss_of_the_adapter_after_the_step(model_factory, tmp_path, method):
    """(ORPO's cross-entropy part is a token mean over the whole validation set's chosen completions.)"""
    from coserve.finetune.runner import run_job
    model_dir = model_factory("llama")
    model, tokenizer = load_model(model_dir, torch.float32, torch.device("cpu")), load_tokenizer(model_dir)
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), method=method, dpo_beta=0.4, batch_size=2, epochs=2,
                         lr=2e-2, eval_steps=1, window_tokens=6)
    pairs, _ = load_training(_write(tmp_path / "p.jsonl", [_openai(w) for w in WORDS[:4]]), tokenizer, cfg)
    held_out, _ = load_training(_write(tmp_path / "v.jsonl", [_openai(w) for w in WORDS[4:]]), tokenizer, cfg)
    bypass = _bypass(model, "lora")
    job = new_job(model, bypass, pairs, cfg, validation=held_out)
    run_job(job, progress=False)
    assert [r.valid_loss is not None for r in job.log] == [False, True, False, True]  # each epoch's end
    assert all(r.valid_batch_loss is not None for r in job.log if r.valid_loss is None)  # eval_steps=1 between
    if method == "orpo":
        want, _ = _reference_free_oracle(model, bypass, held_out, cfg)
    else:
        with torch.no_grad():
            want, _ = _oracle_loss(model, bypass, held_out, cfg.dpo_beta)
    assert job.log[-1].valid_loss == pytest.approx(want, rel=1e-5)
    assert job.log[-1].valid_loss != pytest.approx(job.log[1].valid_loss, rel=1e-3)  # the adapter moved


def _oracle_loss(model, bypass, pairs, beta: float) -> tuple[float, None]:
    losses = []
    for pair in pairs:
        logps = [-whole_sequence_loss(model, b, ex.token_ids, ex.targets, dropout_seed=None)
                 for ex in (pair.chosen, pair.rejected) for b in (bypass, NO_BYPASS)]
        losses.append(-F.logsigmoid(beta * ((logps[0] - logps[1]) - (logps[2] - logps[3]))))
    return float(torch.stack(losses).mean()), None


def test_a_reference_adapter_is_the_reference_and_where_the_job_starts(model_factory, tmp_path):
    from coserve.finetune.build import starting_bypass
    from coserve.finetune.runner import run_job
    from coserve.peft.trainable import load_trainable
    from peft_helpers import make_lora_adapter
    model_dir = model_factory("llama")
    model, tokenizer = load_model(model_dir, torch.float32, torch.device("cpu")), load_tokenizer(model_dir)
    sft = make_lora_adapter(model_dir, tmp_path / "sft", seed=7, r=4, lora_alpha=8,
                            target_modules=["v_proj", "up_proj"])
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), method="dpo", dpo_beta=0.5, batch_size=2, max_steps=1,
                         shuffle=False, lr=1e-3, max_grad_norm=0, window_schedule="random:8", dpo_reference=str(sft))
    pairs, _ = load_training(_write(tmp_path / "p.jsonl", [_openai(w) for w in WORDS[:2]]), tokenizer, cfg)
    bypass = _bypass(model, "lora")  # a policy away from the reference
    reference = load_trainable(sft, model.module_shapes(), model.cfg.num_layers, model.device)
    want_loss, want = _oracle(model, bypass, pairs, cfg.dpo_beta, reference=reference)
    _, from_base = _oracle(model, bypass, pairs, cfg.dpo_beta)
    job = new_job(model, bypass, pairs, cfg)
    got = []
    job.optimizer.step = lambda: got.extend(p.grad.detach().clone() for p in bypass.parameters())
    run_job(job, progress=False)
    assert job.log[0].loss == pytest.approx(want_loss, rel=1e-4)  # (float32 sums of a long rejected completion)
    for g, w, b in zip(got, want, from_base):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6 * float(w.abs().max()))
    assert not all(torch.allclose(w, b) for w, b in zip(want, from_base))  # the reference made a difference
    started = starting_bypass(None, model, cfg)  # a new job starts from the reference: its first loss is log 2
    job = new_job(model, started, pairs, FinetuneConfig(**{**{k: getattr(cfg, k) for k in cfg.__slots__},
                                                           "output_dir": str(tmp_path / "out2")}))
    run_job(job, progress=False)
    # (the policy's forward keeps what its backward reads and the reference's does not: float32 sums 1e-5 apart)
    assert job.log[0].loss == pytest.approx(math.log(2), abs=1e-4)
    assert json.loads((tmp_path / "out2" / "adapter_config.json").read_text())["r"] == 4
    with pytest.raises(ValueError, match=r"^peft: a job from an adapter \(dpo_reference\)"):
        starting_bypass(LoraConfig(), model, cfg)
    with pytest.raises(ValueError, match="^dpo_reference: a reference adapter is for method dpo"):
        FinetuneConfig(output_dir="o", dpo_reference=str(sft))
