"""GRPO (``coserve/finetune/grpo.py``, ``coserve/engine/grpo_run.py``) against TRL's GRPOTrainer math: advantages and
loss normalisations against autograd of TRL's formulas, and whole runs against HF PEFT trained on the same
completions with TRL's loss in a plain torch loop (the completions sampled from the adapter as it stood)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from coserve import LLM, FinetuneConfig, LoraConfig
from coserve.finetune.grpo import completion_example, group_advantages, sequence_scales
from coserve.finetune.sequence_state import IGNORE_INDEX


def _trl_advantages(rewards: list[float], group: int, scale: str) -> torch.Tensor:
    r = torch.tensor(rewards, dtype=torch.float64)
    grouped = r.view(-1, group)
    advantages = r - grouped.mean(dim=1).repeat_interleave(group)
    if scale == "group":
        advantages = advantages / (grouped.std(dim=1).repeat_interleave(group) + 1e-4)
    elif scale == "batch":
        advantages = advantages / (r.std() + 1e-4)
    return advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale):
    rng = random.Random(scale)
    rewards = [rng.choice([0.0, 1.0, rng.random() * 3]) for _ in range(12)]
    rewards[:4] = [2.0] * 4  # a group without spread: advantages 0
    assert group_advantages(rewards, 4, scale) == pytest.approx(_trl_advantages(rewards, 4, scale).tolist(),
                                                                abs=1e-12)
    with pytest.raises(ValueError, match="rewards: 10 is not a whole number of groups of 4"):
        group_advantages(rewards[:10], 4, scale)


def _trl_loss(logps: list[torch.Tensor], advantages: list[float], loss_type: str, batch_size: int,
              max_len: int) -> torch.Tensor:
    """TRL's GRPO loss at ratio 1 (one pass per generation, beta 0), micro-batch by micro-batch, summed as gradient
    accumulation sums them."""
    per_token = [-torch.exp(lp - lp.detach()) * a for lp, a in zip(logps, advantages)]
    n = len(per_token)
    micro = [per_token[k:k + batch_size] for k in range(0, n, batch_size)]
    total_tokens = sum(len(t) for t in per_token)
    loss = 0
    for mb in micro:
        if loss_type == "grpo":  # sequence means, the micro-batch's mean, over the accumulation
            loss = loss + torch.stack([t.mean() for t in mb]).mean() * len(mb) / n
        elif loss_type == "bnpo":
            loss = loss + torch.cat(mb).sum() / sum(len(t) for t in mb) / len(micro)
        elif loss_type == "dr_grpo":
            loss = loss + torch.cat(mb).sum() / (len(mb) * max_len) * len(mb) / n
        else:  # dapo: the tokens of the whole generation batch
            loss = loss + torch.cat(mb).sum() / total_tokens
    return loss


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_sequence_scales_are_the_gradient_of_trls_loss(loss_type):
    """Each token's gradient of TRL's loss with respect to its log-probability is ``-s_i``, micro-batches uneven."""
    rng = random.Random(loss_type)
    lengths = [rng.randint(1, 9) for _ in range(7)]
    advantages = [rng.uniform(-2, 2) for _ in lengths]
    logps = [torch.randn(t, dtype=torch.float64, requires_grad=True) for t in lengths]
    _trl_loss(logps, advantages, loss_type, batch_size=3, max_len=9).backward()
    scales = sequence_scales(advantages, lengths, loss_type, batch_size=3, max_completion_tokens=9)
    for lp, s in zip(logps, scales):
        assert lp.grad.tolist() == pytest.approx([-s] * len(lp), rel=1e-12)
    with pytest.raises(ValueError, match="grpo_loss: 'ppo' is not one of"):
        sequence_scales(advantages, lengths, "ppo", 3, 9)


def test_a_completion_is_trained_on_its_own_tokens_only():
    ex = completion_example([0, 5, 6], [7, 8, 1])
    assert ex.token_ids == [0, 5, 6, 7, 8, 1]
    assert ex.targets == [IGNORE_INDEX, IGNORE_INDEX, 7, 8, 1, IGNORE_INDEX]


def _reward_len(prompts, completions, **kw):
    """Characters, less a point per letter 'e': enough spread within a group of random completions."""
    return [len(c if isinstance(c, str) else c[0]["content"]) / 10 - c.count("e") if isinstance(c, str)
            else len(c[0]["content"]) / 10 for c in completions]


def _reward_answer(prompts, completions, answer, completion_ids, **kw):
    assert len(answer) == len(completions) == len(completion_ids)
    return [None if a is None else float(str(a) in (c if isinstance(c, str) else c[0]["content"]))
            for a, c in zip(answer, completions)]


def _prompts(path):
    records = [{"prompt": "Count to three:", "answer": "3"}, {"prompt": "Name a colour:", "answer": "red"},
               {"prompt": [{"role": "user", "content": "Say hello."}]},
               {"prompt": "Spell cat:", "answer": "c"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("loss_type, optimizer", [("grpo", "sgd"), ("dapo", "adamw")])
def test_grpo_steps_match_hf_peft_on_the_same_completions(model_factory, tmp_path, loss_type, optimizer):
    """Two steps: each step's completions were sampled from the adapter the step before left (their logprobs are
    HF PEFT's under it), and the trained adapter is HF PEFT's after TRL's loss on those completions (SGD without
    clipping: a loss scale off shows, where Adam's normalisation would hide it)."""
    from peft_helpers import PeftTraining, make_lora_adapter
    model_dir = model_factory("llama")
    start = make_lora_adapter(model_dir, tmp_path / "start", seed=3, r=4, lora_alpha=8,
                              target_modules=["q_proj", "v_proj", "down_proj"])
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), method="grpo", num_generations=3, batch_size=3,
                         grad_accum=2, max_completion_tokens=6, max_steps=2, lr=1e-2 if optimizer == "adamw" else 0.5,
                         weight_decay=0.01, seed=5, start_adapter=str(start), grpo_loss=loss_type,
                         optimizer=optimizer, max_grad_norm=1.0 if optimizer == "adamw" else 0.0)
    llm = LLM(model_dir, dtype="float32", device="cpu")
    handle = llm.finetune(_prompts(tmp_path / "p.jsonl"), config=cfg, reward_funcs=[_reward_len, _reward_answer],
                          reward_weights=[1.0, 2.0])
    status = handle.wait(300)
    assert status["status"] == "succeeded", status
    assert [r["step"] for r in handle.log] == [1, 2] and status["step"] == 2
    rollouts = [json.loads(x) for x in (tmp_path / "out" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 12 and all(r["logprobs"] for r in rollouts)

    peft = PeftTraining(model_dir, start, cfg, steps=2)
    for step in (1, 2):
        rows = [r for r in rollouts if r["step"] == step]
        rewards = [r["rewards"]["_reward_len"] + 2 * (r["rewards"]["_reward_answer"] or 0) for r in rows]
        assert [r["reward"] for r in rows] == pytest.approx(rewards, abs=1e-9)  # None skipped, weights applied
        assert [r["advantage"] for r in rows] == pytest.approx(_trl_advantages(rewards, 3, "group").tolist(),
                                                               abs=1e-9)
        logps = []
        for r in rows:
            ids = r["prompt_token_ids"] + r["completion_token_ids"]
            logits = peft.model(input_ids=torch.tensor([ids])).logits[0, len(r["prompt_token_ids"]) - 1:-1]
            lp = F.log_softmax(logits.float(), -1).gather(1, torch.tensor([r["completion_token_ids"]]).T)[:, 0]
            # on-policy: sampled from the adapter as it stood before this step's update
            assert lp.tolist() == pytest.approx(r["logprobs"], abs=2e-4)
            logps.append(lp)
        peft.step(_trl_loss(logps, [r["advantage"] for r in rows], loss_type, cfg.batch_size,
                            cfg.max_completion_tokens))
    from coserve.peft.adapter_dir import read_adapter_tensors
    ours = read_adapter_tensors(tmp_path / "out")
    reference = peft.state()
    assert set(ours) == set(reference)
    for name, ref in reference.items():
        assert float((ours[name] - ref).norm() / ref.norm()) <= 1e-4, name
    log = [json.loads(x) for x in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2]


def test_bad_grpo_input_names_the_field_and_a_failing_reward_fails_the_run(model_factory, tmp_path):
    model_dir = model_factory("llama")
    with pytest.raises(ValueError, match="num_generations: a step's batch_size \\* grad_accum = 4 completions"):
        FinetuneConfig(output_dir="x", method="grpo", num_generations=3, batch_size=4)
    with pytest.raises(ValueError, match="train_on_prompt: GRPO's loss is on the sampled completions only"):
        FinetuneConfig(output_dir="x", method="grpo", num_generations=2, batch_size=2, train_on_prompt=True)
    with pytest.raises(ValueError, match="num_generations: a group of one completion"):
        FinetuneConfig(output_dir="x", method="grpo", num_generations=1, batch_size=1)
    llm = LLM(model_dir, dtype="float32", device="cpu")
    prompts = _prompts(tmp_path / "p.jsonl")
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), method="grpo", num_generations=2, batch_size=2,
                         max_completion_tokens=4, max_steps=1)
    with pytest.raises(ValueError, match="reward_funcs: GRPO needs one or more functions"):
        llm.finetune(prompts, config=cfg)
    with pytest.raises(ValueError, match="reward_weights: expected 1 finite numbers"):
        llm.finetune(prompts, config=cfg, reward_funcs=[_reward_len], reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="reward_funcs: rewards are for method grpo, not sft"):
        llm.finetune(prompts, config=FinetuneConfig(output_dir=str(tmp_path / "o")), reward_funcs=[_reward_len])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="no valid training example among 2 records; line 1: prompt: expected text"):
        llm.finetune(bad, config=cfg, reward_funcs=[_reward_len])

    def broken(prompts, completions, **kw):
        raise KeyError("score")

    handle = llm.finetune(prompts, config=cfg, reward_funcs=[_reward_len, broken])
    status = handle.wait(120)
    assert status["status"] == "failed"
    assert "reward_funcs[1] (broken) raised KeyError" in status["error"]
    out = llm.generate(["still serving"], None)  # the engine keeps serving
    assert out[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="the GRPO run is already failed"):
        handle.cancel()


def test_a_cancelled_grpo_run_stops_and_keeps_its_last_step(model_factory, tmp_path):
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), method="grpo", num_generations=2, batch_size=2,
                         max_completion_tokens=4, max_steps=500)
    handle = llm.finetune(_prompts(tmp_path / "p.jsonl"), peft=LoraConfig(r=2, target_modules=["q_proj"]),
                          config=cfg, reward_funcs=[_reward_len])
    while handle.status()["step"] < 1:
        handle.wait(0.05)
    handle.cancel()
    status = handle.wait(60)
    assert status["status"] == "cancelled" and 1 <= status["step"] < 500
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_a_grpo_run_samples_and_rewards_its_validation_prompts_from_the_adapter_each_step_left(model_factory,
                                                                                           tmp_path):
    """Validation every 2 steps and after the last (5): each is the whole validation set sampled ``eval_samples``
    times from the adapter the step left, rewarded by the run's functions; the oracle for the last one is
    ``LLM.generate`` with the saved adapter and the same sampling, rewarded by hand."""
    from dataclasses import replace

    from coserve import SamplingParams
    from coserve.engine.grpo_run import _VALID_SEEDS, logged_steps
    from coserve.peft.dropout import mix_seed
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    valid = tmp_path / "valid.jsonl"
    valid.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "Add one:", "answer": "2"},
                                                             {"prompt": [{"role": "user", "content": "Hi."}]},
                                                             {"prompt": "Say e:", "answer": "e"}]))
    cfg = FinetuneConfig(output_dir=str(tmp_path / "out"), method="grpo", num_generations=2, batch_size=4,
                         max_completion_tokens=5, max_steps=5, lr=1e-2, seed=7, eval_steps=2, eval_samples=3)
    handle = llm.finetune(_prompts(tmp_path / "p.jsonl"), peft=LoraConfig(r=2, target_modules=["q_proj"]),
                          config=cfg, reward_funcs=[_reward_len, _reward_answer], reward_weights=[1.0, 2.0],
                          validation=valid)
    status = handle.wait(300)
    assert status["status"] == "succeeded" and status["valid_reward"] == handle.log[-1]["valid_reward"]
    assert [("valid_reward" in r) for r in handle.log] == [False, True, False, True, True]
    lines = [json.loads(x) for x in (tmp_path / "out" / "grpo_valid.jsonl").read_text().splitlines()]
    assert [v["step"] for v in lines] == [2, 4, 5] and all(len(v["samples"]) == 9 for v in lines)
    assert logged_steps(tmp_path / "out", 5) == handle.log  # what a resumed run starts from

    llm.load_adapter("after", tmp_path / "out")
    prompts = [list(llm.tokenizer("Add one:")["input_ids"]),
               list(llm.tokenizer(llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}],
                                                                   tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False)["input_ids"]),
               list(llm.tokenizer("Say e:")["input_ids"])]
    outs = llm.generate(prompts, [SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=mix_seed(7, _VALID_SEEDS,
                                                                                                    5, j))
                                  for j in range(3)], adapter="after")
    texts = [c.text for out in outs for c in out.outputs]
    last = lines[-1]
    assert [x["completion"] for x in last["samples"]] == texts
    shown = [t if i // 3 != 1 else [{"role": "assistant", "content": t}] for i, t in enumerate(texts)]
    answers = [a for a in ("2", None, "e") for _ in range(3)]
    rewards = [x + 2 * (y or 0) for x, y in zip(_reward_len(None, shown),
                                                 _reward_answer(None, shown, answers, [[0]] * 9))]
    assert [x["reward"] for x in last["samples"]] == pytest.approx(rewards, abs=1e-12)
    assert handle.log[-1]["valid_reward"] == pytest.approx(sum(rewards) / 9, abs=1e-12)
    assert last["valid_rewards/_reward_answer"] == pytest.approx(
        sum(x for x in _reward_answer(None, shown, answers, [[0]] * 9) if x is not None) / 6, abs=1e-12)
    assert lines[0]["samples"] != lines[1]["samples"]  # each from its own step's adapter and seeds
    with pytest.raises(ValueError, match="eval_samples: must be a positive integer"):
        FinetuneConfig(output_dir=str(tmp_path / "x"), method="grpo", eval_samples=0)
    with pytest.raises(ValueError, match="guided_json: a schema for sampled completions is for method grpo"):
        FinetuneConfig(output_dir=str(tmp_path / "x"), guided_json={"type": "object"})
    with pytest.raises(ValueError, match="guided_json: .*thing"):  # compiled before the run starts
        llm.finetune(_prompts(tmp_path / "p.jsonl"), peft=LoraConfig(r=2, target_modules=["q_proj"]),
                     config=replace(cfg, output_dir=str(tmp_path / "y"), guided_json={"type": "thing"}),
                     reward_funcs=[_reward_len])


def test_the_finetune_command_runs_grpo_with_reward_functions_from_a_file(model_factory, tmp_path, capsys):
    from coserve.cli import main
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def letters(prompts, completions, **kw):  # chat prompts' completions are messages\n"
                       "    texts = [c if isinstance(c, str) else c[0]['content'] for c in completions]\n"
                       "    return [float(sum(ch.isalpha() for ch in t)) for t in texts]\n")
    model, data, out = str(model_factory("llama")), str(_prompts(tmp_path / "p.jsonl")), str(tmp_path / "out")
    common = ["finetune", "--model", model, "--data", data, "--output", out, "--num-generations", "2",
              "--batch-size", "4", "--max-completion-tokens", "5", "--max-steps", "2", "--lora-r", "2"]
    assert main([*common, "--method", "grpo", "--reward", f"{rewards}:letters", "--reward-weight", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "step 2: reward" in printed and "trained 2 steps" in printed
    log = [json.loads(x) for x in (tmp_path / "out" / "grpo_log.jsonl").read_text().splitlines()]
    rollouts = [json.loads(x) for x in (tmp_path / "out" / "rollouts.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2] and len(rollouts) == 8
    assert all(r["reward"] == 0.5 * r["rewards"]["letters"] for r in rollouts)
    more = common[:common.index("--max-steps") + 1] + ["3"] + common[common.index("--max-steps") + 2:]  # resumed
    assert main([*more, "--method", "grpo", "--reward", f"{rewards}:letters", "--init-adapter", out]) == 0
    assert "step 3: reward" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (tmp_path / "out" / "grpo_log.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert main([*common, "--method", "grpo", "--reward", f"{rewards}:nothing"]) == 2
    assert f"--reward: {rewards} has no function 'nothing'" in capsys.readouterr().err
    assert main([*common, "--method", "grpo", "--reward", "letters"]) == 2
    assert "--reward: expected MODULE:FUNC or FILE.py:FUNC, got 'letters'" in capsys.readouterr().err
    assert main([*common, "--reward", f"{rewards}:letters"]) == 2
    assert "--reward: reward functions are for --method grpo, not sft" in capsys.readouterr().err


def test_the_finetune_command_takes_an_openai_grader_as_a_reward(model_factory, tmp_path, capsys):
    from rapidfuzz import fuzz

    from coserve.cli import main
    answers = ["3", "red", "hello", "c"]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}:", "answer": a}) + "\n"
                            for i, a in enumerate(answers)))
    grader = tmp_path / "grader.json"
    grader.write_text(json.dumps({"type": "text_similarity", "name": "close", "evaluation_metric": "fuzzy_match",
                                  "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}"}))
    out = tmp_path / "out"
    common = ["finetune", "--model", str(model_factory("llama")), "--data", str(data), "--output", str(out),
              "--method", "grpo", "--num-generations", "2", "--batch-size", "4", "--max-completion-tokens", "5",
              "--max-steps", "1", "--lora-r", "2"]
    assert main([*common, "--reward", str(grader), "--validation-data", str(data), "--eval-samples", "2"]) == 0
    printed = capsys.readouterr().out
    assert "step 1: reward" in printed and ", validation reward " in printed
    rollouts = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4
    valid = json.loads((out / "grpo_valid.jsonl").read_text())
    assert len(valid["samples"]) == 8  # 4 prompts x 2
    for r in rollouts + valid["samples"]:  # the oracle: rapidfuzz on the completion and the prompt's answer
        expected = fuzz.ratio(r["completion"], answers[r["prompt_line"] - 1]) / 100
        assert r["rewards"]["close"] == pytest.approx(expected, abs=1e-12) and r["reward"] == r["rewards"]["close"]
    grader.write_text(json.dumps({"type": "string_check", "name": "x", "input": "", "reference": "",
                                  "operation": "regex"}))
    assert main([*common, "--reward", str(grader)]) == 2
    assert f"--reward: {grader}: grader.operation: expected one of eq, ne, like, ilike" in capsys.readouterr().err
    assert main([*common, "--reward", str(tmp_path / "none.json")]) == 2
    assert "--reward: cannot read" in capsys.readouterr().err


def test_the_finetune_command_takes_a_label_model_grader_graded_by_the_base_model(model_factory, tmp_path):
    """A model grader in a GRPO run is graded by the engine that trains: each completion's reward is the label the
    base model gives it under the grader's conversation, as ``LLM.chat`` with the same guide gives it."""
    from pathlib import Path

    from coserve import SamplingParams
    from coserve.cli import main
    model = model_factory("llama")
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}:", "topic": t}) + "\n"
                            for i, t in enumerate(["sea", "sky"])))
    labels = ["good", "bad", "odd"]
    grader = tmp_path / "label.json"
    grader.write_text(json.dumps({"type": "label_model", "name": "judge", "model": Path(model).name,
                                  "labels": labels, "passing_labels": ["good"],
                                  "input": [{"role": "user",
                                             "content": "On {{ item.topic }}: {{ sample.output_text }}"}]}))
    out = tmp_path / "out"
    assert main(["finetune", "--model", str(model), "--data", str(data), "--output", str(out), "--method", "grpo",
                 "--num-generations", "2", "--batch-size", "4", "--max-completion-tokens", "4", "--max-steps", "1",
                 "--lora-r", "2", "--reward", str(grader)]) == 0
    rollouts = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    log = json.loads((out / "grpo_log.jsonl").read_text())
    assert len(rollouts) == 4 and "grading_errors" not in log
    llm = LLM(model, dtype="float32", device="cpu")
    topics = ["sea", "sky"]
    replies = llm.chat([[{"role": "user", "content": f"On {topics[r['prompt_line'] - 1]}: {r['completion']}"}]
                        for r in rollouts], SamplingParams(temperature=0, max_tokens=64, guided_choice=labels))
    said = [o.outputs[0].text for o in replies]
    assert set(said) <= set(labels)
    assert [r["reward"] for r in rollouts] == [1.0 if x == "good" else 0.0 for x in said]


def test_a_grpo_run_beside_chat_changes_no_reply_and_trains_what_it_trains_alone(model_factory, tmp_path):
    """Co-serving's promise for RL: user requests batched with the rollouts and the training windows get the
    tokens they get alone, and the run samples the same completions and trains the same adapter as alone."""
    from coserve import SamplingParams
    from coserve.peft.adapter_dir import read_adapter_tensors
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    prompts = _prompts(tmp_path / "p.jsonl")
    users = [[5 + i, 17, 40 + 3 * i, 9] * (1 + i % 3) for i in range(5)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(users, greedy)]

    def run(out: str):
        cfg = FinetuneConfig(output_dir=str(tmp_path / out), method="grpo", num_generations=2, batch_size=4,
                             max_completion_tokens=6, max_steps=3, lr=1e-2, seed=7)
        return llm.finetune(prompts, peft=LoraConfig(r=2, target_modules=["q_proj", "down_proj"]), config=cfg,
                            reward_funcs=[_reward_len])

    assert run("solo").wait(120)["status"] == "succeeded"
    handle, replies = run("beside"), []
    while handle.status()["status"] == "running":
        replies.append([o.outputs[0].token_ids for o in llm.generate(users, greedy)])
    assert handle.status()["status"] == "succeeded" and len(replies) >= 2
    assert all(r == alone for r in replies)
    solo, beside = ([json.loads(x)["completion_token_ids"] for x in (tmp_path / d / "rollouts.jsonl").read_text()
                     .splitlines()] for d in ("solo", "beside"))
    assert solo == beside
    a, b = read_adapter_tensors(tmp_path / "solo"), read_adapter_tensors(tmp_path / "beside")
    for name in a:
        assert float((a[name] - b[name]).norm() / a[name].norm()) <= 1e-5, name


def test_a_grpo_run_resumed_from_its_checkpoint_goes_on_as_if_it_had_not_stopped(model_factory, tmp_path):
    """The adapter and optimizer state saved after every step, the step's prompts and sampling seeds fixed by the
    step: a run stopped after a step and resumed from its output directory samples and trains what one that never
    stopped does."""
    from dataclasses import replace

    from coserve.peft.adapter_dir import read_adapter_tensors
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    prompts = _prompts(tmp_path / "p.jsonl")
    cfg = FinetuneConfig(output_dir=str(tmp_path / "whole"), method="grpo", num_generations=2, batch_size=4,
                         max_completion_tokens=5, max_steps=4, lr=1e-2, seed=11, lr_scheduler="cosine",
                         warmup_steps=1)
    peft = LoraConfig(r=2, target_modules=["q_proj", "down_proj"])
    assert llm.finetune(prompts, peft=peft, config=cfg, reward_funcs=[_reward_len]).wait(120)["status"] == "succeeded"
    part = replace(cfg, output_dir=str(tmp_path / "part"))
    first = llm.finetune(prompts, peft=peft, config=part, reward_funcs=[_reward_len])
    while first.status()["step"] < 1:
        first.wait(0.01)
    first.cancel()
    stopped_at = first.wait(60)["step"]
    assert 1 <= stopped_at < 4
    with pytest.raises(ValueError, match="peft: a resumed job trains the checkpoint's adapter"):
        llm.finetune(prompts, peft=peft, config=part, reward_funcs=[_reward_len], resume_from=part.output_dir)
    rest = llm.finetune(prompts, config=part, reward_funcs=[_reward_len], resume_from=part.output_dir)
    assert rest.wait(120)["status"] == "succeeded" and rest.status()["step"] == 4
    assert [r["step"] for r in rest.log] == [1, 2, 3, 4]  # the checkpoint's records of its steps, then its own

    def lines(run: str, name: str) -> list[dict]:
        return [json.loads(x) for x in (tmp_path / run / name).read_text().splitlines()]

    assert [r["completion_token_ids"] for r in lines("part", "rollouts.jsonl")] == [
        r["completion_token_ids"] for r in lines("whole", "rollouts.jsonl")]
    assert [r["step"] for r in lines("part", "grpo_log.jsonl")] == [1, 2, 3, 4]
    a, b = read_adapter_tensors(tmp_path / "whole"), read_adapter_tensors(tmp_path / "part")
    for name in a:
        assert float((a[name] - b[name]).norm() / a[name].norm()) <= 1e-6, name
    with pytest.raises(ValueError, match="resume_from: .* is at step 4; the run has 4"):
        llm.finetune(prompts, config=part, reward_funcs=[_reward_len], resume_from=part.output_dir)
    # a server that stopped between a job's last step and its end resumes it as finished (finished_ok)
    from coserve.engine.grpo_run import GRPORun
    from coserve.engine.loop_client import LoopClient
    from coserve.finetune.grpo_prompts import load_prompts
    done = GRPORun(LoopClient(llm._background()), load_prompts(prompts, llm.tokenizer, 512, 5)[0], [_reward_len], None,
                   llm._starting_bypass(None, part, part.output_dir), part, resume_from=part.output_dir,
                   finished_ok=True)
    done.start()
    assert done.join(60) and done.status == "succeeded" and done.step == 4
    assert [r["step"] for r in done.log] == [1, 2, 3, 4]
    again = read_adapter_tensors(tmp_path / "part")
    assert all(torch.equal(again[name], b[name]) for name in b)  # nothing trained again


def test_a_validation_cut_short_is_done_again_when_the_run_resumes(model_factory, tmp_path):
    """A run stopped after saving a step but before that step's validation ended (a crash, a pause): resumed, it
    validates the step first, from the same adapter with the same seeds, so the step's record and
    ``grpo_valid.jsonl`` come out as if it had not stopped."""
    import shutil
    from dataclasses import replace
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    valid = tmp_path / "valid.jsonl"
    valid.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "Add one:"}, {"prompt": "Say e:"}]))
    cfg = FinetuneConfig(output_dir=str(tmp_path / "whole"), method="grpo", num_generations=2, batch_size=4,
                         max_completion_tokens=5, max_steps=2, lr=1e-2, seed=3, eval_steps=2, eval_samples=2)
    peft = LoraConfig(r=2, target_modules=["q_proj"])
    whole = llm.finetune(_prompts(tmp_path / "p.jsonl"), peft=peft, config=cfg, reward_funcs=[_reward_len],
                         validation=valid)
    assert whole.wait(120)["status"] == "succeeded" and "valid_reward" in whole.log[-1]
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)  # as a crash after step 2's save, before its validation, leaves it
    lines = (cut / "grpo_valid.jsonl").read_text().splitlines()
    (cut / "grpo_valid.jsonl").write_text("".join(x + "\n" for x in lines if json.loads(x)["step"] != 2))
    on = llm.finetune(_prompts(tmp_path / "p.jsonl"), config=replace(cfg, output_dir=str(cut), max_steps=3),
                      reward_funcs=[_reward_len], validation=valid, resume_from=str(cut))
    assert on.wait(120)["status"] == "succeeded" and [r["step"] for r in on.log] == [1, 2, 3]
    assert on.log[1]["valid_reward"] == whole.log[1]["valid_reward"]
    redone = [json.loads(x) for x in (cut / "grpo_valid.jsonl").read_text().splitlines()]
    assert [v["step"] for v in redone] == [2, 3]
    assert redone[0]["samples"] == json.loads(lines[-1])["samples"]  # the same completions and rewards
