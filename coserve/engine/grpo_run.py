"""A GRPO run on an engine running in its own thread (``LLM.finetune`` with ``method="grpo"``, or the server's
reinforcement fine-tuning jobs): rollouts and training co-served.

Each step, in a thread of its own: the adapter as it stands is loaded for serving; the step's prompts are sampled
``num_generations`` times through the engine (requests like any other, batched with whatever else the engine
serves); the reward functions score the completions; and one ``GRPOStepJob`` (``coserve/finetune/grpo.py``) trains
on them as a finetuning job, interleaved with inference by the engine's scheduler, continuing the optimizer of the
step before. The next step's completions come from the adapter that step left (on-policy: TRL's ``num_iterations``
1). ``output_dir`` holds the adapter and optimizer state after every step, ``training_log.jsonl``, each step's
rewards (``grpo_log.jsonl``) and every completion with its reward and advantage (``rollouts.jsonl``).

With validation prompts, the whole validation set is sampled (``eval_samples`` completions a prompt) from the adapter
a step left and rewarded, every ``eval_steps`` steps (each epoch's end when 0) and after the last step: the step's
record gains ``valid_reward`` (OpenAI's ``valid_reward_mean``), and ``grpo_valid.jsonl`` a line with every validation
completion and its rewards. A validation cut short (by a pause, or a crash, after its step was saved) is done again
first when the run resumes, from the same adapter with the same seeds, before the step's record is given out.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from coserve.engine.loop_client import LoopClient
from coserve.finetune.checkpoint import GRPO_LOG_FILE, GRPO_VALID_FILE, ROLLOUTS_FILE, load_optimizer_state
from coserve.finetune.config import FinetuneConfig
from coserve.finetune.grpo import (GRPOStepJob, completion_example, group_advantages, sample_std,
                                   sequence_scales)
from coserve.finetune.grpo_prompts import PromptRecord
from coserve.peft.adapter_dir import write_adapter_files
from coserve.peft.dropout import mix_seed
from coserve.peft.trainable import TrainableBypass
from coserve.scheduler import SamplingParams
from coserve.scheduler.sampling_params import Reasoning, ReasoningTokens

RewardFunc = Callable[..., Sequence[float | None]]
_VALID_SEEDS = 0x56414C  # mixed into the validation completions' seeds, apart from the training rollouts'


def reward_name(func: RewardFunc, index: int) -> str:
    return getattr(func, "__name__", None) or f"reward_{index}"


def score(funcs: Sequence[RewardFunc], weights: Sequence[float], prompts: list, completions: list,
          completion_ids: list[list[int]], columns: dict[str, list]) -> tuple[list[float], dict[str, list[float]]]:
    """The completions' rewards: each function called as TRL calls it (``prompts``, ``completions``,
    ``completion_ids`` and the data set's other fields as keyword lists), their weighted sum ignoring None (a
    function that does not apply to a completion), and each function's own values. Errors name the function."""
    total = [0.0] * len(completions)
    per_func: dict[str, list[float]] = {}
    for i, (func, weight) in enumerate(zip(funcs, weights)):
        name = reward_name(func, i)
        try:
            values = list(func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns))
        except Exception as e:
            raise ValueError(f"reward_funcs[{i}] ({name}) raised {type(e).__name__}: {e}") from e
        if len(values) != len(completions):
            raise ValueError(f"reward_funcs[{i}] ({name}): {len(values)} rewards for {len(completions)} completions")
        clean = []
        for j, v in enumerate(values):
            if v is None:
                clean.append(math.nan)
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isinf(v):
                raise ValueError(f"reward_funcs[{i}] ({name}): reward {j} is {v!r}, not a finite number or None")
            clean.append(float(v))
            total[j] += weight * float(v)
        per_func[name] = clean
    return total, per_func


def logged_steps(out_dir: Path, last: int) -> list[dict]:
    """The step records of a run's ``grpo_log.jsonl`` up to step ``last`` (none if it has no log), each with its
    validation's summary from ``grpo_valid.jsonl`` where it had one."""
    records = [r for r in _jsonl(out_dir / GRPO_LOG_FILE) if r.get("step", 0) <= last]
    valid = {v["step"]: valid_summary(v) for v in _jsonl(out_dir / GRPO_VALID_FILE)}
    return [{**r, **valid.get(r["step"], {})} for r in records]


def valid_summary(line: dict) -> dict:
    """A ``grpo_valid.jsonl`` line's fields for the step's record (all but its step and its completions)."""
    return {k: v for k, v in line.items() if k not in ("step", "samples")}


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_rewards(per_func: dict[str, list[float]], prefix: str) -> dict[str, float | None]:
    """Each reward function's mean over the completions it applied to (None: to none), named ``prefix + name``."""
    out = {}
    for name, values in per_func.items():
        kept = [v for v in values if not math.isnan(v)]
        out[f"{prefix}{name}"] = sum(kept) / len(kept) if kept else None
    return out


class GRPORun:
    """One GRPO run; ``start()`` begins it in a thread. ``status``: running, succeeded, failed or cancelled."""

    def __init__(self, client: LoopClient, prompts: list[PromptRecord], reward_funcs: Sequence[RewardFunc],
                 reward_weights: Sequence[float] | None, bypass: TrainableBypass, cfg: FinetuneConfig,
                 tenant: str = "default", base_model: str = "", resume_from: Path | None = None,
                 on_step: Callable[[dict], None] | None = None, finished_ok: bool = False,
                 validation: list[PromptRecord] | None = None, reasoning: Reasoning | None = None) -> None:
        """``client``: the engine (running in its own thread) that samples and trains. ``resume_from``: a
        checkpoint a run of the same data and config wrote after a step (its ``output_dir``); the run goes on from
        that step as if it had not stopped (``bypass`` its adapter). ``on_step``: called in the run's thread with
        each step's record once ``output_dir`` holds that step and its validation, if due, is done (and before the
        next step begins). ``finished_ok``: a checkpoint at the run's last step is not an error; the run then
        succeeds at once (a server that stopped between a job's last step and its end). ``validation``: prompts
        (with the fields the reward functions read) sampled and rewarded as the module says. ``reasoning``: a
        reasoning model's parser (a server's ``--reasoning-parser``): completions are sampled as its chat replies are
        (a ``guided_json`` schema constrains the reply after the reasoning), and the reward functions see the reply
        alone, as OpenAI's graders see a reasoning model's output text; training is on every token sampled."""
        if not prompts:
            raise ValueError("data: no prompts")
        if validation is not None and not validation:
            raise ValueError("validation: no prompts")
        funcs = list(reward_funcs or [])
        if not funcs or not all(callable(f) for f in funcs):
            raise ValueError("reward_funcs: GRPO needs one or more functions (prompts, completions, **fields) -> "
                             "rewards")
        weights = [1.0] * len(funcs) if reward_weights is None else list(reward_weights)
        if len(weights) != len(funcs) or not all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                 and math.isfinite(w) for w in weights):
            raise ValueError(f"reward_weights: expected {len(funcs)} finite numbers, got {reward_weights!r}")
        if cfg.guided_json is not None:
            SamplingParams(guided_json=cfg.guided_json)  # compiled now: ValueError naming guided_json when it is bad
        self.client, self.prompts, self.funcs, self.weights = client, prompts, funcs, weights
        self.validation = validation
        self.on_step = on_step
        self.reasoning = reasoning
        self.bypass, self.cfg, self.tenant, self.base_model = bypass, cfg, tenant, base_model
        self.per_step = cfg.batch_size * cfg.grad_accum // cfg.num_generations  # prompts a step
        self.steps_per_epoch = math.ceil(len(prompts) / self.per_step)
        self.total_steps = cfg.max_steps or self.steps_per_epoch * cfg.epochs
        self.output_dir = Path(cfg.output_dir)
        self.resume_from = Path(resume_from) if resume_from is not None else None
        self.status, self.error, self.step = "running", None, 0
        if self.resume_from is not None:
            saved = load_optimizer_state(self.resume_from)
            if saved is None:
                raise ValueError(f"resume_from: {self.resume_from} holds no optimizer state (not a checkpoint)")
            self.step = int(saved.get("step", 0))
            if self.step >= self.total_steps and not finished_ok:
                raise ValueError(f"resume_from: {self.resume_from} is at step {self.step}; the run has "
                                 f"{self.total_steps}")
        self.log: list[dict] = []  # one record a step, as grpo_log.jsonl holds them (a resumed run's earlier ones too)
        if self.resume_from is not None:
            self.log = logged_steps(self.resume_from, self.step)
        self._revalidate: dict | None = None  # the resumed step's record, whose due validation was cut short
        if (validation is not None and self.log and self.log[-1]["step"] == self.step
                and "valid_reward" not in self.log[-1] and self._valid_due(self.step)):
            self._revalidate = self.log.pop()
        self.job: GRPOStepJob | None = None  # the latest step's job
        self._job_id: str | None = None
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="coserve-grpo", daemon=True)
        self._adapter_name = f"grpo-rollout-{id(self):x}"  # the adapter the rollouts sample from, while loaded
        self._loaded: int | None = None  # the step whose adapter is loaded under that name (None: none is)

    def start(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def cancel(self) -> None:
        """Stop the run: rollouts under way are aborted and a step in training is dropped (``output_dir`` keeps
        the last whole step), but a step already being saved lands whole. ValueError once the run has ended."""
        with self._lock:
            if self.status != "running":
                raise ValueError(f"the GRPO run is already {self.status}")
            self._cancelled.set()
            self.client.abort()  # the step's rollouts, if under way
            jid = self._job_id
            if jid is not None:
                engine = self.client.engine

                def stop_training() -> None:  # a step whose optimizer step is done and being saved is kept whole
                    if not engine.saver.saving(jid):
                        engine.cancel_finetune_job(jid)
                try:
                    self.client.loop.post_and_wait(stop_training)
                except ValueError:
                    pass  # the step's job ended meanwhile
            self.status = "cancelled"

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- one run ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._revalidate is not None:
                self._step_done(self._revalidate)
            for step in range(self.step, self.total_steps):
                if self._cancelled.is_set():
                    return
                self._one_step(step)
            with self._lock:
                if self.status == "running":
                    self.status = "succeeded"
        except Exception as e:  # reported through status(); the engine keeps serving
            with self._lock:
                if self.status == "running":
                    self.status, self.error = "failed", f"{type(e).__name__}: {e}"
        finally:
            self._unload()

    def _step_prompts(self, step: int) -> list[PromptRecord]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.prompts)))
        if self.cfg.shuffle:
            random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
        return [self.prompts[i] for i in order[offset * self.per_step:(offset + 1) * self.per_step]]

    def _one_step(self, step: int) -> None:
        cfg, g = self.cfg, self.cfg.num_generations
        batch = self._step_prompts(step)
        started = time.perf_counter()
        outs = self._rollouts(step, batch)
        rollout_s = time.perf_counter() - started
        if self._cancelled.is_set():
            return  # its rollouts were aborted
        records = [p for p in batch for _ in range(g)]
        completions = [c for out in outs for c in out.outputs]
        ids = [list(c.token_ids) for c in completions]
        parts = [self._split(r, c) for r, c in zip(records, completions)]
        rewards, per_func, graded = self._score(records, completions, parts)
        score_s = time.perf_counter() - started - rollout_s
        advantages = group_advantages(rewards, g, cfg.scale_rewards)
        lengths = [len(c) for c in ids]
        scales = sequence_scales(advantages, lengths, cfg.grpo_loss, cfg.batch_size, cfg.max_completion_tokens)
        examples = [completion_example(r.token_ids, c) for r, c in zip(records, ids)]
        job = GRPOStepJob(self.client.engine.model, self.bypass, examples, scales, cfg, self.total_steps,
                          previous=self.job, base_model=self.base_model,
                          resume_from=self.resume_from if self.job is None else None)
        lines = self._rollout_lines(step, records, completions, parts, rewards, per_func, advantages)
        made: list[dict] = []  # the step's record, made once its optimizer step is done (it has the loss)

        def step_logs() -> dict[str, str]:  # written with the step's checkpoint (GRPOStepJob.step_logs)
            if not made:
                timing = {"rollout_s": round(rollout_s, 4), "score_s": round(score_s, 4),
                          "train_s": round(time.perf_counter() - training, 4)}  # training: up to its save
                made.append(self._record(step, rewards, per_func, lengths, completions, job) | timing | graded)
            return {GRPO_LOG_FILE: json.dumps(made[0]) + "\n", ROLLOUTS_FILE: lines}

        job.step_logs = step_logs
        training = time.perf_counter()
        if not self._train(job):
            return  # cancelled: the adapter of the last whole step stays in output_dir
        self.job, self.step = job, job.step
        step_logs()  # made already by the step's save
        self._step_done(made[0])

    def _step_done(self, record: dict) -> None:
        """A saved step's record, its validation done where due, given out (``log``, ``on_step``)."""
        if self.validation is not None and self._valid_due(self.step):
            record.update(self._validate(self.step))
        self.log.append(record)
        if self.on_step is not None:
            self.on_step(record)

    def _valid_due(self, step: int) -> bool:
        return step % (self.cfg.eval_steps or self.steps_per_epoch) == 0 or step == self.total_steps

    def _validate(self, step: int) -> dict:
        """The validation set sampled from the adapter after ``step`` steps and rewarded: the step record's
        ``valid_*`` fields (none if the run was cancelled meanwhile), its completions added to ``grpo_valid.jsonl``
        (replaced whole: ``output_dir`` keeps it through the checkpoints to come)."""
        cfg, k = self.cfg, self.cfg.eval_samples
        started = time.perf_counter()
        params = [SamplingParams(n=k, temperature=cfg.temperature, max_tokens=cfg.max_completion_tokens,
                                 seed=mix_seed(cfg.seed, _VALID_SEEDS, step, j), guided_json=cfg.guided_json,
                                 reasoning=self._tags(p))
                  for j, p in enumerate(self.validation)]
        try:
            outs = self._sample(self.validation, params)
        except RuntimeError:
            if self._cancelled.is_set():
                return {}  # the client was aborted before these requests reached it
            raise
        if self._cancelled.is_set():
            return {}
        records = [p for p in self.validation for _ in range(k)]
        completions = [c for out in outs for c in out.outputs]
        parts = [self._split(r, c) for r, c in zip(records, completions)]
        rewards, per_func, graded = self._score(records, completions, parts)
        lengths = [len(c.token_ids) for c in completions]
        summary = {"valid_reward": sum(rewards) / len(rewards),
                   "valid_reward_std": sample_std(rewards) if len(rewards) > 1 else 0.0,
                   **mean_rewards(per_func, "valid_rewards/"),
                   "valid_completions_mean_length": sum(lengths) / len(lengths),
                   "valid_s": round(time.perf_counter() - started, 4),
                   **{f"valid_{key}": v for key, v in graded.items()}}
        samples = [{"prompt_line": r.line, "completion": c.text, **parts[i],
                    "completion_token_ids": list(c.token_ids), "finish_reason": c.finish_reason, "reward": rewards[i],
                    "rewards": {n: None if math.isnan(v[i]) else v[i] for n, v in per_func.items()}}
                   for i, (r, c) in enumerate(zip(records, completions))]
        path = self.output_dir / GRPO_VALID_FILE
        kept = path.read_text() if path.is_file() else ""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(kept + json.dumps({"step": step, **summary, "samples": samples}) + "\n")
        os.replace(tmp, path)
        return summary

    def _score(self, records: list[PromptRecord], completions: list, parts: list[dict]
               ) -> tuple[list[float], dict[str, list[float]], dict]:
        """``score`` of completions, each of the prompt record beside it, as the reward functions see them (the
        reply of ``parts``, ``_split``'s, where the run has a reasoning parser); and what graders report of the call
        (``graders.grader_reward``): completions they could not grade (scored 0), by ``<grader>/<kind>``
        (``grading_errors``), and their models' tokens (``grader_tokens``), where any."""
        texts = [p.get("reply", c.text) for p, c in zip(parts, completions)]
        ids = [list(c.token_ids) for c in completions]
        columns = {k: [r.columns.get(k) for r in records] for k in sorted({k for r in records for k in r.columns})}
        shown = [[{"role": "assistant", "content": t}] if r.conversational else t for r, t in zip(records, texts)]
        rewards, per_func = score(self.funcs, self.weights, [r.prompt for r in records], shown, ids, columns)
        errors = {f"{reward_name(f, i)}/{kind}": n for i, f in enumerate(self.funcs)
                  for kind, n in getattr(f, "grading_errors", {}).items()}
        tokens: dict[str, dict[str, int]] = {}
        for f in self.funcs:
            for model, n in getattr(f, "grading_tokens", {}).items():
                mine = tokens.setdefault(model, {"prompt_tokens": 0, "completion_tokens": 0})
                mine["prompt_tokens"] += n["prompt_tokens"]
                mine["completion_tokens"] += n["completion_tokens"]
        return rewards, per_func, ({"grading_errors": errors} if errors else {}) | (
            {"grader_tokens": tokens} if tokens else {})

    def _rollout_lines(self, step: int, records: list[PromptRecord], completions: list, parts: list[dict],
                       rewards: list[float], per_func: dict[str, list[float]], advantages: list[float]) -> str:
        """The step's lines of ``rollouts.jsonl``: every completion with its prompt, logprobs, rewards, advantage."""
        g, lines = self.cfg.num_generations, []
        for i, (r, c) in enumerate(zip(records, completions)):
            own = {k: None if math.isnan(v[i]) else v[i] for k, v in per_func.items()}  # None: did not apply
            lines.append(json.dumps({"step": step + 1, "prompt_line": r.line, "group": i // g,
                                     "prompt_token_ids": r.token_ids, "completion": c.text, **parts[i],
                                     "completion_token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                                     "logprobs": [lp.logprob for lp in c.logprobs] if c.logprobs else None,
                                     "reward": rewards[i], "rewards": own, "advantage": advantages[i]}) + "\n")
        return "".join(lines)

    def _rollouts(self, step: int, batch: list[PromptRecord]):
        """The step's completions from the adapter as it stands."""
        cfg = self.cfg
        params = [SamplingParams(n=cfg.num_generations, temperature=cfg.temperature,
                                 max_tokens=cfg.max_completion_tokens, logprobs=0,
                                 seed=mix_seed(cfg.seed, step, j), guided_json=cfg.guided_json, reasoning=self._tags(p))
                  for j, p in enumerate(batch)]
        return self._sample(batch, params)

    def _tags(self, prompt: PromptRecord) -> ReasoningTokens | None:
        return self.reasoning.tokens(prompt.token_ids) if self.reasoning is not None else None

    def _split(self, prompt: PromptRecord, completion) -> dict[str, str | None]:
        """A completion's ``reasoning`` (None without any) and ``reply`` (what the reward functions see), where the
        run has a reasoning parser; else nothing."""
        if self.reasoning is None:
            return {}
        reasoning, reply = self.reasoning.split(self.reasoning.tokens(prompt.token_ids), completion.text)
        return {"reasoning": reasoning, "reply": reply or ""}

    def _sample(self, prompts: list[PromptRecord], params: list[SamplingParams]):
        """Completions of ``prompts`` from the adapter as it stands (saved and loaded for serving under one name,
        once a step)."""
        if self._loaded != self.step:
            self._unload()
            with tempfile.TemporaryDirectory(prefix="coserve-grpo-") as tmp:
                state = {k: v.detach().to("cpu", copy=True) for k, v in self.bypass.state_dict().items()}
                write_adapter_files(Path(tmp), state, self.bypass.peft_config(self.base_model))
                self.client.load_adapter(self._adapter_name, tmp)
            self._loaded = self.step
        return self.client.generate([p.token_ids for p in prompts], params, adapter=self._adapter_name,
                                    tenant=self.tenant)

    def _unload(self) -> None:
        if self._loaded is not None:
            self._loaded = None
            try:
                self.client.unload_adapter(self._adapter_name)
            except ValueError:
                pass

    def _train(self, job: GRPOStepJob) -> bool:
        """The step's job, co-served by the engine until it ends (then dropped from the engine's books: a run adds
        one a step); True if it trained, False if the run was cancelled; a failed one ends the run."""
        loop, engine = self.client.loop, self.client.engine
        with self._lock:
            if self._cancelled.is_set():
                return False
            self._job_id = jid = loop.call(lambda: engine.add_finetune_job(job, tenant=self.tenant))
        states = engine.job_states
        loop.wait_until(lambda: states[jid].status != "running")
        state = loop.call(lambda: states.pop(jid))
        with self._lock:
            self._job_id = None
        if state.status == "failed":
            raise RuntimeError(f"step {job.step + 1}: {state.error}")
        return state.status == "succeeded"

    def _record(self, step: int, rewards, per_func, lengths, completions, job: GRPOStepJob) -> dict:
        g = self.cfg.num_generations
        groups = [rewards[k:k + g] for k in range(0, len(rewards), g)]
        stds = [0.0 if len(x) < 2 else sample_std(x) for x in groups]
        last = job.log[-1] if job.log else None
        record = {"step": step + 1, "loss": last.loss if last else None, "lr": last.lr if last else None,
                  "reward": sum(rewards) / len(rewards), "reward_std": sum(stds) / len(stds),
                  "frac_reward_zero_std": sum(s == 0 for s in stds) / len(stds),
                  "completions_mean_length": sum(lengths) / len(lengths),
                  "completions_clipped_ratio": sum(c.finish_reason == "length" for c in completions) / len(lengths)}
        return record | mean_rewards(per_func, "rewards/")


class GRPOHandle:
    """A GRPO run co-served by an ``LLM``'s engine: ``status()``, ``wait()``, ``cancel()``, ``output_dir``, ``log``."""

    def __init__(self, run: GRPORun, data_report: str) -> None:
        self._run = run
        self.output_dir = run.output_dir
        self.data_report = data_report

    @property
    def log(self) -> list[dict]:
        return list(self._run.log)

    def status(self) -> dict:
        """``{"status", "error", "step", "total_steps", "reward", "loss", "valid_reward"}`` (the last step's, and
        the latest validation's mean reward: None before any)."""
        run = self._run
        last = run.log[-1] if run.log else {}
        valid = next((r["valid_reward"] for r in reversed(run.log) if "valid_reward" in r), None)
        return {"status": run.status, "error": run.error, "step": run.step, "total_steps": run.total_steps,
                "reward": last.get("reward"), "loss": last.get("loss"), "valid_reward": valid}

    def wait(self, timeout: float | None = None) -> dict:
        self._run.join(timeout)
        return self.status()

    def cancel(self) -> None:
        """Stop the run (the adapter of its last finished step stays in ``output_dir``); ValueError once ended."""
        self._run.cancel()
