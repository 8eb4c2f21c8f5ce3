"""The finetuning job: resume, non-finite losses, atomic checkpoints, serving the result."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from coserve import LLM, SamplingParams
from coserve.finetune import checkpoint
from coserve.finetune.config import FinetuneConfig
from coserve.finetune.job import FinetuneError, FinetuneJob
from coserve.finetune.runner import run_job
from coserve.model.loader import load_model
from coserve.peft.config import LoraConfig
from coserve.peft.trainable import TrainableLora, load_trainable
from coserve.finetune.sequence_state import IGNORE_INDEX as IGNORE
from test_finetune_vs_peft import _examples


@pytest.fixture
def setup(model_factory):
    model_dir = model_factory("llama")
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    examples = _examples(model.cfg.vocab_size, 8, seed=11)

    def bypass(seed=0):
        return TrainableLora(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]),
                             model.module_shapes(), model.cfg.num_layers, model.device,
                             torch.Generator().manual_seed(seed))

    return model_dir, model, examples, bypass


def _cfg(out, **kw):
    base = dict(output_dir=str(out), batch_size=2, lr=1e-2, max_steps=4, seed=3, window_tokens=5,
                lr_scheduler="cosine", warmup_steps=1)
    return FinetuneConfig(**{**base, **kw})


def test_resume_continues_exactly(setup, tmp_path):
    model_dir, model, examples, bypass = setup
    whole = bypass()
    uninterrupted = FinetuneJob(model, whole, examples, _cfg(tmp_path / "whole"))
    run_job(uninterrupted, progress=False)
    first = bypass()
    half = FinetuneJob(model, first, examples, _cfg(tmp_path / "half"))
    while half.step < 2:
        kind = half.next_work()
        (half.forward if kind == "forward" else half.backward)(5)
    at_step_2 = half.tokens_done
    half.forward(5)  # into step 3: a checkpoint now is still step 2's
    half.save()
    resumed_bypass = load_trainable(tmp_path / "half", model.module_shapes(), model.cfg.num_layers, model.device)
    resumed = FinetuneJob(model, resumed_bypass, examples, _cfg(tmp_path / "rest"), resume_from=tmp_path / "half")
    assert resumed.step == 2 and resumed.tokens_done == at_step_2 > 0  # trained tokens carry over
    run_job(resumed, progress=False)
    assert resumed.tokens_done == uninterrupted.tokens_done
    for name, tensor in whole.state_dict().items():
        torch.testing.assert_close(resumed_bypass.state_dict()[name], tensor, rtol=1e-6, atol=1e-7)


def test_non_finite_losses_are_skipped_then_stop_the_job(setup, tmp_path):
    model_dir, model, examples, bypass = setup
    b = bypass()
    job = FinetuneJob(model, b, examples, _cfg(tmp_path / "out", max_steps=8, max_nonfinite_steps=2))
    job.save()  # a good checkpoint to keep
    good = {k: v.clone() for k, v in b.state_dict().items()}
    with torch.no_grad():
        for p in b.parameters():
            p.fill_(float("nan"))
    with pytest.raises(FinetuneError, match="non-finite"):
        run_job(job, progress=False)
    assert [r.skipped for r in job.log] == [True, True]
    log = [json.loads(x) for x in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    assert all("skipped" in x and math.isnan(x["loss"]) for x in log)
    saved = load_trainable(tmp_path / "out", model.module_shapes(), model.cfg.num_layers, model.device)
    for name, tensor in saved.state_dict().items():  # no corrupt adapter was written
        assert torch.equal(tensor, good[name])


def test_a_non_finite_gradient_with_a_finite_loss_skips_the_step(setup, tmp_path):
    model_dir, model, examples, bypass = setup
    b = bypass()
    job = FinetuneJob(model, b, examples, _cfg(tmp_path / "out", max_steps=2))
    before = {k: v.clone() for k, v in b.state_dict().items()}
    step = job._optimizer_step

    def poisoned():  # one element of the last parameter's gradient overflows
        grads = [p.grad for p in b.parameters() if p.grad is not None]
        grads[-1].view(-1)[0] = float("inf")
        step()
    job._optimizer_step = poisoned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_job(job, progress=False)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]  # a skipped step is not a misordered one
    assert [r.skipped for r in job.log] == [True, True] and all(math.isfinite(r.loss) for r in job.log)
    assert job.scheduler.last_epoch == 2  # skipped steps count: lr stays the schedule's at ``step``
    for name, tensor in b.state_dict().items():  # no step was taken
        assert torch.equal(tensor, before[name])


def test_a_crash_while_saving_leaves_the_previous_checkpoint_whole(setup, tmp_path, monkeypatch):
    model_dir, model, examples, bypass = setup
    out = tmp_path / "out"
    job = FinetuneJob(model, bypass(), examples, _cfg(out, max_steps=2))
    run_job(job, progress=False)
    before = (out / "adapter_model.safetensors").read_bytes()

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)  # the optimizer state is written after the adapter
    with pytest.raises(OSError):
        job.save()
    assert (out / "adapter_model.safetensors").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
    # a crash between the two renames: the previous directory is brought back
    (out).rename(tmp_path / ".out.old")
    checkpoint.recover(out)
    assert (out / "adapter_model.safetensors").read_bytes() == before


def test_the_trained_adapter_is_served_by_the_engine(setup, tmp_path):
    model_dir, model, examples, bypass = setup
    job = FinetuneJob(model, bypass(), examples, _cfg(tmp_path / "out", lr=0.5, max_steps=3))
    run_job(job, progress=False)
    llm = LLM(model_dir, dtype="float32", device="cpu")
    llm.load_adapter("trained", tmp_path / "out")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    base, tuned = llm.generate(["Hello", "Hello"], params, adapter=[None, "trained"])
    assert base.token_ids != tuned.token_ids


@pytest.mark.parametrize("remat", ["cheap", "all"])
@pytest.mark.parametrize("peft", ["lora", "ia3", "dora"])
def test_the_executor_keeps_exactly_the_plans_bytes(setup, tmp_path, peft, remat):
    from coserve.peft.config import IA3Config
    from coserve.peft.trainable import TrainableIA3
    model_dir, model, examples, bypass = setup
    if peft == "dora":  # DoRA keeps each module's unscaled output beside x A^T
        b = TrainableLora(LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["v_proj", "down_proj"]),
                          model.module_shapes(), model.cfg.num_layers, model.device, torch.Generator().manual_seed(0),
                          base_weight=model.module_weight)
    else:
        b = bypass() if peft == "lora" else TrainableIA3(IA3Config(), model.module_shapes(), model.cfg.num_layers,
                                                         model.device)
    job = FinetuneJob(model, b, examples, _cfg(tmp_path / "o", max_steps=1, rematerialize=remat))
    run_job(job, progress=False)
    plan = job.plan
    assert job.kept_bytes_per_token == plan.model_kept_bytes_per_token
    assert plan.model_kept_bytes_per_token < plan.model_keep_all_bytes_per_token


@pytest.mark.parametrize("remat", ["cheap", "all"])
def test_the_executor_keeps_exactly_the_plans_bytes_with_qk_norms(model_factory, tmp_path, remat):
    """Qwen3: the plan's q/k norm inputs and per-head statistics are what the executor stores (or recomputes)."""
    model = load_model(model_factory("qwen3"), torch.float32, torch.device("cpu"))
    b = TrainableLora(LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "down_proj"]), model.module_shapes(),
                      model.cfg.num_layers, model.device, torch.Generator().manual_seed(0))
    job = FinetuneJob(model, b, _examples(model.cfg.vocab_size, 4, seed=11),
                      _cfg(tmp_path / "o", max_steps=1, rematerialize=remat))
    run_job(job, progress=False)
    kept = {k.name for k in job.plan.kept}
    assert ({"q_rms", "k_rms"} <= kept) == (remat == "cheap")
    assert job.kept_bytes_per_token == job.plan.model_kept_bytes_per_token


def test_sequences_longer_than_the_rope_table_are_refused_clearly(setup, tmp_path):
    from coserve.finetune.job import Example
    model_dir, model, examples, bypass = setup
    too_long = Example(list(range(5, 5 + model.rope.max_positions + 1)), [IGNORE] * (model.rope.max_positions + 1))
    with pytest.raises(ValueError, match="positions"):
        FinetuneJob(model, bypass(), examples + [too_long], _cfg(tmp_path / "o"))


def test_finetune_cli_trains_past_the_nominal_context(model_factory, tmp_path):
    from coserve.cli import main
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": "word " * 700}) + "\n")  # > 512 tokens, the tiny preset's context
    assert main(["finetune", "--model", str(model_factory("llama")), "--data", str(data), "--output",
                 str(tmp_path / "o"), "--max-steps", "1", "--max-seq-len", "800", "--no-progress"]) == 0


@pytest.mark.parametrize("remat", ["cheap", "all"])
@pytest.mark.parametrize("peft", ["lora", "ia3"])
def test_bfloat16_models_train(model_factory, tmp_path, remat, peft):
    from coserve.peft.config import IA3Config
    from coserve.peft.trainable import TrainableIA3
    model = load_model(model_factory("llama"), torch.bfloat16, torch.device("cpu"))
    examples = _examples(model.cfg.vocab_size, 4, seed=2)
    if peft == "lora":
        b = TrainableLora(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]), model.module_shapes(),
                          model.cfg.num_layers, model.device, torch.Generator().manual_seed(0))
    else:
        b = TrainableIA3(IA3Config(), model.module_shapes(), model.cfg.num_layers, model.device)
    job = FinetuneJob(model, b, examples, _cfg(tmp_path / "o", max_steps=2, rematerialize=remat))
    run_job(job, progress=False)
    assert all(math.isfinite(r.loss) and not r.skipped for r in job.log)
    assert all(p.dtype == torch.float32 for p in b.parameters())  # the adapter trains in float32


def test_validation_loss_after_each_epoch_matches_a_plain_forward(setup, tmp_path):
    from coserve.finetune.job import Example
    from coserve.finetune.reference import whole_sequence_logits, whole_sequence_loss
    model_dir, model, examples, _ = setup
    validation = []
    for e in _examples(model.cfg.vocab_size, 3, seed=12):  # every other target: the base model's own prediction
        with torch.no_grad():
            predicted = whole_sequence_logits(model, None, e.token_ids, None).argmax(-1).tolist()
        validation.append(Example(e.token_ids, [p if i % 2 and t != IGNORE else t
                                                for i, (t, p) in enumerate(zip(e.targets, predicted))]))
    total = sum(sum(t != IGNORE for t in e.targets) for e in validation)

    def lora():
        return TrainableLora(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["v_proj", "down_proj"]),
                             model.module_shapes(), model.cfg.num_layers, model.device, torch.Generator().manual_seed(1))

    def oracle(bypass):  # the validation set's mean loss per target token and token accuracy, no dropout
        with torch.no_grad():
            loss = sum(float(whole_sequence_loss(model, bypass, e.token_ids, e.targets, dropout_seed=None))
                       for e in validation) / total
            correct = sum(int((whole_sequence_logits(model, bypass, e.token_ids, None).argmax(-1)
                               == torch.tensor(e.targets)).sum()) for e in validation)
        return loss, correct / total

    cfg = dict(max_steps=0, epochs=2, batch_size=4)  # 2 steps an epoch
    plain = lora()
    run_job(FinetuneJob(model, plain, examples, _cfg(tmp_path / "plain", **cfg)), progress=False)
    bypass = lora()
    job = FinetuneJob(model, bypass, examples, _cfg(tmp_path / "v", **cfg), validation=validation)
    expected = {}
    job.on_step = lambda j: expected.__setitem__(j.step, oracle(j.bypass))  # published after its validation
    run_job(job, progress=False)

    assert [r.step for r in job.log] == [1, 2, 3, 4]
    assert [r.valid_loss is not None for r in job.log] == [False, True, False, True]
    for r in job.log[1::2]:
        assert r.valid_loss == pytest.approx(expected[r.step][0], rel=1e-5)
        assert r.valid_accuracy == expected[r.step][1] > 0.1
    assert job.log[1].valid_loss != job.log[3].valid_loss
    lines = [json.loads(line) for line in (tmp_path / "v" / checkpoint.LOG_FILE).read_text().splitlines()]
    assert [("valid_loss" in line) for line in lines] == [False, True, False, True]
    assert [line.get("valid_mean_token_accuracy") for line in lines] == [r.valid_accuracy for r in job.log]
    for name, tensor in plain.state_dict().items():  # validation runs change nothing of the training
        assert torch.equal(bypass.state_dict()[name], tensor)


def test_eval_steps_run_a_validation_batch_in_turn_between_the_epochs(setup, tmp_path):
    """OpenAI's per-step ``valid_loss``: every ``eval_steps`` steps, the next ``batch_size`` validation examples
    (in turn) run forward-only; an epoch's end still runs the whole set. Training is unchanged."""
    from coserve.finetune.reference import whole_sequence_logits, whole_sequence_loss
    model_dir, model, examples, bypass = setup
    validation = _examples(model.cfg.vocab_size, 3, seed=13)

    def oracle(b, indices):
        with torch.no_grad():
            chosen = [validation[i] for i in indices]
            total = sum(sum(t != IGNORE for t in e.targets) for e in chosen)
            loss = sum(float(whole_sequence_loss(model, b, e.token_ids, e.targets, dropout_seed=None))
                       for e in chosen) / total
            correct = sum(int((whole_sequence_logits(model, b, e.token_ids, None).argmax(-1)
                               == torch.tensor(e.targets)).sum()) for e in chosen)
        return loss, correct / total

    cfg = dict(max_steps=0, epochs=2, batch_size=2, eval_steps=1)  # 4 steps an epoch
    plain = bypass()
    run_job(FinetuneJob(model, plain, examples, _cfg(tmp_path / "plain", **{**cfg, "eval_steps": 0})),
            progress=False)
    b = bypass()
    job = FinetuneJob(model, b, examples, _cfg(tmp_path / "v", **cfg), validation=validation)
    batches = iter([[0, 1], [2, 0], [1, 2], [2, 0], [1, 2], [0, 1]])  # steps 1-3 and 5-7: batch k - 1 of 2
    expected = {}
    job.on_step = lambda j: expected.__setitem__(j.step, oracle(j.bypass, next(batches)) if j.step % 4
                                                 else oracle(j.bypass, [0, 1, 2]))
    run_job(job, progress=False)
    assert [r.step for r in job.log] == list(range(1, 9))
    for r in job.log:
        full = r.step % 4 == 0
        got = (r.valid_loss, r.valid_accuracy) if full else (r.valid_batch_loss, r.valid_batch_accuracy)
        assert got[0] == pytest.approx(expected[r.step][0], rel=1e-5) and got[1] == expected[r.step][1]
        assert (r.valid_batch_loss is None) == full and (r.valid_loss is None) != full
    lines = [json.loads(line) for line in (tmp_path / "v" / checkpoint.LOG_FILE).read_text().splitlines()]
    assert [("valid_batch_loss" in x, "valid_loss" in x) for x in lines] == [(r.step % 4 != 0, r.step % 4 == 0)
                                                                            for r in job.log]
    for name, tensor in plain.state_dict().items():
        assert torch.equal(b.state_dict()[name], tensor)
