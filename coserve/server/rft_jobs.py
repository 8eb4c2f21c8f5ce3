"""Reinforcement fine-tuning jobs (OpenAI's ``method: {"type": "reinforcement"}``) on the server: a GRPO run
(``coserve/engine/grpo_run.py``) whose reward is the job's grader (``coserve/finetune/graders.py``), co-served by
the server's engine like any job.

The run's ``model`` directory holds the adapter and optimizer state of its last whole step (written atomically),
so a job paused, or left running by a server that stopped, goes on from there. Every ``checkpoint_every`` steps
the adapter is copied into a servable checkpoint. Each step becomes a metrics event with its mean reward (and,
where the job validated, the validation prompts' mean reward).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coserve.engine.grpo_run import GRPORun
from coserve.engine.loop_client import LoopClient
from coserve.finetune.build import make_bypass, starting_bypass
from coserve.finetune.checkpoint import load_optimizer_state, write_dir_atomically
from coserve.finetune.config import FinetuneConfig
from coserve.finetune.graders import grader_reward, parse_grader
from coserve.finetune.grpo_prompts import load_prompts
from coserve.peft.adapter_dir import CONFIG_FILE, WEIGHTS_FILE
from coserve.peft.config import IA3Config, LoraConfig
from coserve.peft.trainable import load_model_trainable
from coserve.server.followed_job import FollowedJob
from coserve.server.grader_judge import server_judge
from coserve.server.response_format import guided_schema

if TYPE_CHECKING:
    from coserve.server.jobs import JobManager

log = logging.getLogger("coserve.server")
_SHOW = 5  # bad data lines named in a job's error


@dataclass(slots=True)
class RFTRunning(FollowedJob):
    """A reinforcement job the engine is co-serving, and how far the watcher has followed it."""

    run: GRPORun
    model_dir: Path
    grading: LoopClient  # the model grader's requests (aborted with the run's)
    grader: tuple[str, str]  # its name and type
    first_step: int = 0  # the step it started (or resumed) at, read before its run's thread began

    @property
    def step(self) -> int:
        return self.run.step

    @property
    def total_steps(self) -> int:
        return self.run.total_steps

    @property
    def tokens_done(self) -> int:
        return self.run.job.tokens_done if self.run.job is not None else self.tokens

    def step_metrics(self, step: int) -> dict:
        """A step's metrics under OpenAI's names (``train_reward_mean``; after a validation ``valid_reward_mean``
        and its ``full_valid_mean_reward``: the whole validation set; a model grader's ``model_graders_token_usage``)
        and GRPO's (``rewards/<grader>``); samples the grader could not grade (scored 0) by ``<grader>/<error flag>``
        in ``grading_errors``."""
        rec = next((r for r in reversed(self.run.log) if r["step"] == step), None)
        if rec is None:
            return {"step": step, "train_reward_mean": None}
        extra = {k: v for k, v in rec.items()
                 if k.startswith(("rewards/", "valid_rewards/")) or k in ("grading_errors", "valid_grading_errors")}
        usage: dict[str, dict[str, int]] = {}  # OpenAI's model_graders_token_usage: train_ and eval_ tokens by model
        for key, prefix in (("grader_tokens", "train_"), ("valid_grader_tokens", "eval_")):
            for model, n in rec.get(key, {}).items():
                usage.setdefault(model, {})
                usage[model] |= {f"{prefix}prompt_tokens": n["prompt_tokens"],
                                 f"{prefix}completion_tokens": n["completion_tokens"]}
        if usage:
            extra["model_graders_token_usage"] = usage
        if "valid_reward" in rec:
            extra |= {"valid_reward_mean": rec["valid_reward"], "full_valid_mean_reward": rec["valid_reward"],
                      "valid_reward_std": rec["valid_reward_std"],
                      "valid_completions_mean_length": rec["valid_completions_mean_length"]}
        return {"step": step, "total_steps": self.total_steps, "train_loss": rec["loss"],
                "train_reward_mean": rec["reward"], "train_mean_reward": rec["reward"],
                "train_reward_std": rec["reward_std"], "frac_reward_zero_std": rec["frac_reward_zero_std"],
                "completions_mean_length": rec["completions_mean_length"],
                "completion_tokens_mean": rec["completions_mean_length"],
                "completions_clipped_ratio": rec["completions_clipped_ratio"], **extra, **self._openai_objects(rec)}

    def _openai_objects(self, rec: dict) -> dict:
        """OpenAI's per-grader objects of a metrics event: ``scores``, ``errors`` (each flag's count and mean over
        the step's samples, train and valid) and ``timing`` (seconds of the step's parts)."""
        name, kind = self.grader
        mine = {"name": name, "type": kind}
        scores = {"train_reward_mean": rec["reward"],
                  "graders": [mine | {"train_reward_mean": rec.get(f"rewards/{name}", rec["reward"])}]}
        if "valid_reward" in rec:
            scores["valid_reward_mean"] = rec["valid_reward"]
            scores["graders"][0]["valid_reward_mean"] = rec.get(f"valid_rewards/{name}", rec["valid_reward"])
        errors = dict(mine)
        for prefix, key, n in (("train", "grading_errors", self.run.cfg.batch_size),
                               ("valid", "valid_grading_errors", self.valid_samples)):
            for flag, count in rec.get(key, {}).items():
                flag = flag.split("/", 1)[1]
                errors |= {f"{prefix}_{flag}_count": count, f"{prefix}_{flag}_mean": count / max(1, n)}
        parts = {"sampling": rec.get("rollout_s"), "grading": rec.get("score_s"), "training": rec.get("train_s"),
                 "eval": rec.get("valid_s")}
        step = {k: v for k, v in parts.items() if v is not None}
        step["full_iteration"] = round(sum(step.values()), 4)
        return {"scores": scores, "errors": {"graders": [errors]}, "timing": {"step": step}}

    @property
    def valid_samples(self) -> int:
        return len(self.run.validation or ()) * self.run.cfg.eval_samples


def rft_fields(job: dict, checkpoint_steps: int) -> dict:
    """A stored reinforcement job's GRPO settings beside those every job has (``jobs.stored_config``):
    ``batch_size`` prompts a step, each sampled ``num_generations`` x ``compute_multiplier`` times (at least
    twice); with a validation file, validation every ``eval_interval`` steps ("auto": at each checkpoint, which is
    every ``checkpoint_steps``, or each epoch's end when 0); completions matching ``response_format``'s schema."""
    opts, hyper = job["coserve"], job["hyperparameters"]
    g = max(2, round(opts["num_generations"] * hyper["compute_multiplier"]))
    every = hyper.get("eval_interval", "auto")  # jobs stored before validation: none
    schema = guided_schema(job["method"]["reinforcement"].get("response_format"))  # checked when the job was made
    return dict(method="grpo", batch_size=hyper["batch_size"] * g, grad_accum=1, num_generations=g,
                guided_json=schema,
                max_completion_tokens=opts["max_completion_tokens"], temperature=opts["temperature"],
                grpo_loss=opts["grpo_loss"], scale_rewards=opts["scale_rewards"],
                eval_steps=(checkpoint_steps or 0) if every == "auto" else every,
                eval_samples=hyper.get("eval_samples", 1))


def start_rft(mgr: JobManager, tenant: str, job: dict, name: str, cfg: FinetuneConfig) -> RFTRunning:
    """Start (or resume, from ``cfg.output_dir``) a stored reinforcement job with its configuration ``cfg``;
    ValueError naming the field, file or lines when it cannot run."""
    job_id, opts = job["id"], job["coserve"]
    model = mgr.engine.model
    out = Path(cfg.output_dir)
    grader = parse_grader(job["method"]["reinforcement"]["grader"], "method.reinforcement.grader",
                          allow_python=mgr.config.python_graders)  # the server may have restarted without the flag
    prompts = _prompts(mgr, job, "training_file", cfg)
    validation = _prompts(mgr, job, "validation_file", cfg) if job.get("validation_file") else None
    saved = load_optimizer_state(out)
    resume = out if saved is not None else None
    if resume is not None:
        bypass = load_model_trainable(out, model)
    elif opts.get("start_from"):
        bypass = starting_bypass(None, model, FinetuneConfig(output_dir=str(out),
                                                             start_adapter=str(mgr.state_dir / opts["start_from"])))
    else:
        p = dict(opts["peft_config"])
        kind = p.pop("peft")
        bypass = make_bypass(IA3Config(**p) if kind == "ia3" else LoraConfig(**p), model, job["seed"])
    holder: list[RFTRunning] = []
    grading = LoopClient(mgr.loop)
    reward = grader_reward(grader, server_judge(mgr.models, mgr.loop, tenant, grading, mgr.reasoning))
    run = GRPORun(LoopClient(mgr.loop), prompts, [reward], None, bypass, cfg, tenant,
                  base_model=mgr.base_name, resume_from=resume, on_step=lambda rec: _on_step(holder[0], rec),
                  finished_ok=True, validation=validation, reasoning=mgr.reasoning)
    tokens = int(saved.get("tokens", 0)) if saved else 0  # a resumed job's tokens are counted already
    r = RFTRunning(job_id, tenant, name, mgr.config.checkpoint_steps or run.steps_per_epoch, run, out, grading,
                   (grader.name, grader.type), tokens=tokens, first_step=run.step)
    holder.append(r)
    run.start()
    return r


def _prompts(mgr: JobManager, job: dict, param: str, cfg: FinetuneConfig) -> list:
    """The job's ``param`` file's prompts; a ValueError naming the file and its first bad lines if any is bad."""
    file_id = job[param]
    path = mgr.store.file_path(file_id)
    try:
        prompts, report = load_prompts(path, mgr.engine.tokenizer, cfg.max_seq_len, cfg.max_completion_tokens)
    except ValueError as e:  # a file with no usable prompt: named by its id, not by the server's path
        raise ValueError(str(e).replace(str(path), f"{param} {file_id}")) from None
    if report.malformed:
        named = "; ".join(f"line {n}: {why}" for n, why in sorted(report.malformed)[:_SHOW])
        raise ValueError(f"{param} {file_id}: {len(report.malformed)} prompt(s) cannot be used: {named}")
    return prompts


def _on_step(r: RFTRunning, record: dict) -> None:
    """In the run's thread, once the model directory holds the step: a servable checkpoint every
    ``checkpoint_every`` steps but the last (the finished model is that one)."""
    step = record["step"]
    if step % r.checkpoint_every or step >= r.run.total_steps:
        return
    path = r.model_dir.parent / "checkpoints" / f"step-{step}"
    try:
        copy_adapter(r.model_dir, path)
    except OSError:  # training goes on; the next checkpoint may land (the job's events do not show server paths)
        log.exception("copying reinforcement job %s's checkpoint at step %d failed", r.job_id, step)
        return
    r.saved.append((step, path))


def copy_adapter(src: Path, dest: Path) -> None:
    """The adapter files of ``src`` into the directory ``dest``, which appears whole or not at all."""
    write_dir_atomically(dest, lambda tmp: [shutil.copy2(src / name, tmp / name) for name in (CONFIG_FILE,
                                                                                             WEIGHTS_FILE)])


def follow_rft(mgr: JobManager, r: RFTRunning) -> str:
    """Record what a reinforcement job did since the last look (steps as metrics events, checkpoints) and how it
    ended if it has; returns its status (the caller forgets a job that ended)."""
    status, error = r.run.status, r.run.error  # a run ends with its log whole (a cancelled one: see _take_rft_off)
    tokens, counted = r.tokens_done, r.tokens
    mgr.metrics.finetune.add(tokens - counted)
    r.tokens = tokens
    records = r.run.log[r.logged:]
    r.logged += len(records)
    for rec in records:
        if not mgr.store.has_step_event(r.job_id, rec["step"]):
            loss = "" if rec["loss"] is None else f", training loss={rec['loss']:.4f}"
            if "valid_reward" in rec:
                loss += f", full validation mean reward={rec['valid_reward']:.4f}"
            mgr.store.add_event(r.job_id, f"Step {rec['step']}/{r.total_steps}: mean reward="
                                f"{rec['reward']:.4f}{loss}", type="metrics",
                                data={**r.step_metrics(rec["step"]), "learning_rate": rec["lr"], "tokens": tokens})
    while r.saved:  # after the events of their steps (the run's thread appends to the list)
        mgr.record_checkpoint(r, *r.saved.pop(0))
    if records or tokens != counted:  # the store is written when something changed, not at every look
        job = mgr.store.get_job(None, r.job_id)
        mgr.store.update_job(r.job_id, trained_tokens=tokens, coserve={**job["coserve"], "step": r.step})
    if status == "succeeded":
        mgr.succeed(r, r.model_dir)
    elif status == "failed":
        mgr.fail(r.job_id, error or "the job failed", "training_failed")
    return status
