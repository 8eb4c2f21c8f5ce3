"""Fine-tuning jobs as a service: queued in the store, co-served by the engine, followed into events and
checkpoints, and resumed from their last checkpoint after a restart.

One watcher thread starts queued jobs (tokenizing their data off the engine thread), turns each optimizer
step into a metrics event, saves a servable checkpoint every ``checkpoint_steps`` (or epoch), and records
how each job ends. Every engine access goes through ``EngineLoop.post_and_wait`` (between iterations).
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from coserve.engine.engine_loop import EngineLoop
from coserve.engine.llm_engine import FinetuneMemoryError
from coserve.finetune.build import load_training, make_bypass, new_job, starting_bypass
from coserve.finetune.checkpoint import CheckpointSnapshot, write_checkpoint
from coserve.finetune.config import PREFERENCE_METHODS, FinetuneConfig
from coserve.finetune.graph_pruning import DEFAULT_MEMORY_TARGET
from coserve.finetune.job import FinetuneJob, StepRecord
from coserve.finetune.memory_budget import job_memory
from coserve.peft import AdapterError
from coserve.peft.adapter_dir import peft_type, read_adapter_config
from coserve.server.followed_job import FollowedJob
from coserve.peft.config import IA3Config, LoraConfig, default_targets, for_model
from coserve.peft.trainable import load_model_trainable
from coserve.scheduler.sampling_params import Reasoning
from coserve.server.config import ServerConfig
from coserve.server.errors import APIError, bad_request, found, not_found
from coserve.server.grader_judge import request_grader
from coserve.server.metrics import ServerMetrics
from coserve.server.models import ModelRegistry, checkpoint_name, fine_tuned_name
from coserve.server.protocol import (CoserveOptions, DpoHyperparameters, FineTuningJobRequest, Hyperparameters,
                                     ReinforcementHyperparameters)
from coserve.server.response_format import guided_schema
from coserve.server.rft_jobs import RFTRunning, copy_adapter, follow_rft, rft_fields, start_rft
from coserve.server.store import Store

log = logging.getLogger("coserve.server")
POLL_S = 0.25  # the watcher looks at running jobs this often
STOP_WAIT_S = 30.0  # how long a pause or cancel waits for a reinforcement job's run to stop (a rollout to end)
DEFAULT_MAX_SEQ_LEN = 1024  # training sequences are cut here unless the job asks otherwise (or the context is shorter)
BASE_LR = 1e-4  # learning_rate_multiplier scales this
AUTO = {"n_epochs": 3, "batch_size": 1, "learning_rate_multiplier": 1.0, "beta": 0.1}  # what "auto" resolves to
# a reinforcement job's: a step's batch_size prompts, each sampled num_generations x compute_multiplier times
RFT_AUTO = {"n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 0.1, "compute_multiplier": 1.0}
LIMITS = {"n_epochs": (1, 50), "batch_size": (1, 256), "learning_rate_multiplier": (1e-4, 100.0),
          "beta": (1e-3, 2.0), "compute_multiplier": (0.1, 8.0)}  # (beta: DPO's, OpenAI's range)
METHOD_ONLY = {"beta": "dpo", "compute_multiplier": "reinforcement"}  # hyperparameters of one method
ACTIVE = ("validating_files", "queued", "running")
HOLDS_FILES = (*ACTIVE, "paused")  # jobs whose files must stay (a paused job reads them again when resumed)
SUFFIX = re.compile(r"[A-Za-z0-9._-]{1,64}")
REFERENCE_FREE = ("simpo", "orpo")  # preference methods a DPO job's coserve.dpo_loss may name
PEFT_OPTIONS = ("peft", "r", "lora_alpha", "lora_dropout", "use_rslora", "use_dora", "target_modules",
                "target_parameters")
_SHOW = 5  # bad data lines named in a job's error


def stored_config(job: dict, out: Path, **fields) -> FinetuneConfig:
    """A stored job's FinetuneConfig: what every method shares (epochs, batch, learning rate x ``BASE_LR``,
    optimizer and schedule, sequence length, seed, memory), with ``fields`` (its method's) added or overriding."""
    opts, hyper = job["coserve"], job["hyperparameters"]
    shared = dict(output_dir=str(out), epochs=hyper["n_epochs"], max_steps=opts["max_steps"],
                  batch_size=hyper["batch_size"], grad_accum=opts["grad_accum"],
                  lr=BASE_LR * hyper["learning_rate_multiplier"], optimizer=opts["optimizer"],
                  lr_scheduler=opts["lr_scheduler"], warmup_steps=opts["warmup_steps"],
                  weight_decay=opts["weight_decay"], max_grad_norm=opts["max_grad_norm"],
                  max_seq_len=opts["max_seq_len"], seed=job["seed"],
                  rematerialize=opts.get("rematerialize", "cheap"),  # jobs stored before the options: defaults
                  memory_target=opts.get("memory_target", DEFAULT_MEMORY_TARGET))
    return FinetuneConfig(**{**shared, **fields})


def step_metrics(rec: StepRecord) -> dict:
    """An optimizer step's metrics under OpenAI's names (the validation set runs whole: ``full_valid_*``)."""
    metrics = {"step": rec.step, "train_loss": rec.loss, "train_mean_token_accuracy": rec.accuracy}
    if rec.reward_accuracy is not None:  # a DPO step's
        metrics["train_reward_accuracy"], metrics["train_reward_margin"] = rec.reward_accuracy, rec.reward_margin
    if rec.valid_batch_loss is not None:  # a validation batch (eval_steps)
        metrics["valid_loss"] = rec.valid_batch_loss
        metrics["valid_mean_token_accuracy"] = rec.valid_batch_accuracy
    if rec.valid_loss is not None:
        metrics["full_valid_loss"] = rec.valid_loss
        metrics["full_valid_mean_token_accuracy"] = rec.valid_accuracy
    return metrics


class WaitForMemory(Exception):
    """The job fits the finetuning memory budget alone but not beside the running jobs: it stays queued."""


@dataclass(slots=True)
class Running(FollowedJob):
    """A supervised or preference job the engine is co-serving, and how far the watcher has followed it."""

    job: FinetuneJob
    writes: list[Future] = field(default_factory=list)  # its checkpoints still being written
    write_errors: list[str] = field(default_factory=list)  # checkpoints that could not be written, not yet told

    @property
    def step(self) -> int:
        return self.job.step

    @property
    def tokens_done(self) -> int:
        return self.job.tokens_done

    def step_metrics(self, step: int) -> dict:
        """An optimizer step's metrics, as its events and checkpoints carry them."""
        rec = next((rec for rec in reversed(self.job.log) if rec.step == step), None)
        return step_metrics(rec) if rec is not None else {"step": step, "train_loss": None}

    def wait_for_writes(self) -> None:
        """Once the job has ended: let the checkpoints it left being written land (their outcome is in ``saved``
        or ``write_errors``)."""
        for write in self.writes:
            write.exception()
        self.writes.clear()


class JobManager:
    def __init__(self, store: Store, loop: EngineLoop, config: ServerConfig, metrics: ServerMetrics,
                 models: ModelRegistry, reasoning: Reasoning | None = None) -> None:
        self.store, self.loop, self.config, self.metrics, self.models = store, loop, config, metrics, models
        self.reasoning = reasoning  # --reasoning-parser: reinforcement rollouts reason; their graders read replies
        self.engine = loop.engine
        self.base_name = models.base
        self.state_dir = Path(config.state_dir)
        self.jobs_dir = self.state_dir / "jobs"
        self.running: dict[str, Running] = {}
        self._lock = threading.RLock()  # job state transitions: the watcher's tick and cancel
        self._files_lock = threading.Lock()  # a file's deletion against a job being created on it
        self._memory_full: frozenset[str] | None = None  # the running jobs when the next one did not fit beside them
        self._told_waiting: set[str] = set()  # jobs whose "waiting for memory" event is recorded
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="coserve-jobs", daemon=True)
        # Checkpoints are copied on the engine thread and written on this one, in order: inference does not wait
        # for the disk (a checkpoint of an 8B model's LoRA and AdamW state is hundreds of MB).
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coserve-checkpoints")

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Requeue jobs a previous process left running (they resume from their last checkpoint), then watch."""
        for _, job in self.store.jobs_with_status("running", "validating_files"):
            found = self.store.latest_checkpoint(job["id"])
            where = f"its checkpoint at step {found[0]['step_number']}" if found else "the start"
            self.store.update_job(job["id"], status="queued")
            self.store.add_event(job["id"], f"The server restarted; the job is queued to resume from {where}")
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._writer.shutdown(wait=True)  # a checkpoint being written lands whole (or, killed, not at all)

    def _run(self) -> None:
        while not self._stop:
            try:
                with self._lock:
                    self._start_queued()
                    self._follow()
            except Exception:  # one bad tick must not end the watcher
                log.exception("the job watcher failed")
            self._wake.wait(POLL_S)
            self._wake.clear()

    # ---- the API's side ----------------------------------------------------------------------------------
    def create(self, tenant: str, body: FineTuningJobRequest) -> dict:
        """Validate a job request and queue it; errors name the field."""
        with self._files_lock:  # its files cannot be deleted until the job is recorded (and holds them)
            return self._create(tenant, body)

    def delete_file(self, tenant: str, file_id: str) -> None:
        """Delete the tenant's file: 404 if it has none by that id, 409 while a queued or running job uses it."""
        with self._files_lock:
            found(self.store.get_file(tenant, file_id), "file", file_id, "file_id")
            in_use = [j["id"] for owner, j in self.store.jobs_with_status(*HOLDS_FILES)
                      if owner == tenant and file_id in (j["training_file"], j["validation_file"])]
            if in_use:
                raise APIError(409, f"The file is in use by fine-tuning job {in_use[0]}", "file_id", "file_in_use")
            self.store.delete_file(tenant, file_id)

    def _create(self, tenant: str, body: FineTuningJobRequest) -> dict:
        start = self._start_model(tenant, body) if body.model != self.base_name else None
        for param, file_id in (("training_file", body.training_file), ("validation_file", body.validation_file)):
            if file_id is None:
                continue
            f = found(self.store.get_file(tenant, file_id), "file", file_id, param)
            if f["purpose"] != "fine-tune":
                raise bad_request(f"{param}: file {file_id} has purpose '{f['purpose']}', not 'fine-tune'", param)
        if body.suffix is not None and not SUFFIX.fullmatch(body.suffix):
            raise bad_request("suffix: 1-64 letters, digits, '.', '_' or '-'", "suffix")
        method = body.method.type if body.method is not None else "supervised"
        hyper = self._hyperparameters(body, method)
        if method == "reinforcement":
            grader = self._grader(tenant, body)
            hyper |= self._evaluation(body)
        method_object = {"hyperparameters": dict(hyper)}
        if method == "reinforcement":
            method_object = {"grader": grader, **method_object}
            if body.method.reinforcement.response_format is not None:
                method_object["response_format"] = self._response_format(body)
        options = body.coserve or CoserveOptions()
        if options.dpo_label_smoothing and options.dpo_loss not in ("sigmoid", "simpo"):
            raise bad_request("coserve.dpo_label_smoothing: only the sigmoid and the simpo losses smooth labels",
                              "coserve.dpo_label_smoothing")
        peft = self._peft(options) if start is None else start[1]
        if options.max_seq_len is None:
            options.max_seq_len = min(DEFAULT_MAX_SEQ_LEN, self.engine.max_model_len)
        if options.max_seq_len > self.engine.max_model_len:
            raise bad_request(f"coserve.max_seq_len: {options.max_seq_len} exceeds the model's context "
                              f"({self.engine.max_model_len})", "coserve.max_seq_len")
        if self.store.count_jobs(*ACTIVE, tenant=tenant) >= self.config.max_queued_jobs:
            raise APIError(429, f"Too many fine-tuning jobs queued or running (at most {self.config.max_queued_jobs} "
                           "per tenant); wait for one to finish", code="too_many_jobs")
        job_id = Store.new_id("ftjob")
        seed = body.seed if body.seed is not None else random.randrange(2**31)
        job = {
            "id": job_id, "object": "fine_tuning.job", "created_at": int(time.time()), "finished_at": None,
            "model": body.model, "fine_tuned_model": None, "organization_id": tenant, "status": "queued",
            "training_file": body.training_file, "validation_file": body.validation_file, "result_files": [],
            "hyperparameters": hyper, "trained_tokens": None, "error": None, "seed": seed,
            "user_provided_suffix": body.suffix, "estimated_finish": None, "integrations": [],
            "metadata": body.metadata,
            "method": {"type": method, method: method_object},
            "coserve": {**options.model_dump(), "peft_config": peft, "step": 0, "total_steps": None,
                        "start_from": start[0] if start else None},
        }
        self.store.add_job(tenant, job)
        self.store.add_event(job_id, f"Created fine-tuning job {job_id}")
        self.store.add_event(job_id, "Files validated, moving job to queued state")
        self._wake.set()
        return self.store.get_job(tenant, job_id)

    def _start_model(self, tenant: str, body: FineTuningJobRequest) -> tuple[str, dict]:
        """A job on the tenant's fine-tuned model or checkpoint ``body.model`` trains on from its adapter (OpenAI's
        "fine-tune a fine-tuned model"; a DPO job takes it as the reference too): where the adapter lies, relative to
        the state directory, and its PEFT config, which the request cannot change. 404 unless the tenant may use
        the model."""
        path = self.models.fine_tuned_path(tenant, body.model)
        if path is None:
            raise not_found("model", body.model, "model")
        given = sorted(set(PEFT_OPTIONS) & (body.coserve.model_fields_set if body.coserve else set()))
        if given:
            raise bad_request(f"coserve.{given[0]}: the job trains on from {body.model}, whose adapter decides "
                              "its PEFT settings", f"coserve.{given[0]}")
        try:
            raw = read_adapter_config(path)
        except AdapterError as e:
            log.warning("the adapter of %s cannot be read: %s", body.model, e)
            raise APIError(400, f"The model '{body.model}' cannot be fine-tuned: its adapter cannot be read",
                           "model", "model_not_supported") from e
        kind = peft_type(raw).lower()
        fields = ("target_modules", "feedforward_modules") if kind == "ia3" else PEFT_OPTIONS[1:]
        peft = {"peft": kind, **{k: raw.get(k) for k in fields}}
        return (str(path.relative_to(self.state_dir)) if path.is_relative_to(self.state_dir) else str(path)), peft

    def cancel(self, tenant: str, job_id: str) -> dict:
        with self._lock:
            job = self.owned(tenant, job_id)
            if job["status"] not in HOLDS_FILES:
                raise APIError(409, f"The job is already {job['status']} and cannot be cancelled",
                               code="job_not_cancellable")
            if job_id in self.running:
                self._take_off_engine(job_id, "cancelled", "job_not_cancellable")
            self._left_queue(job_id)
            self.store.add_event(job_id, "Job cancelled")
            return self.store.update_job(job_id, status="cancelled", finished_at=int(time.time()))

    def pause(self, tenant: str, job_id: str) -> dict:
        """Stop a running or queued job where it is, keeping it resumable: a running job leaves the engine (its
        memory is freed) with a checkpoint of its last optimizer step, from which ``resume`` goes on."""
        with self._lock:
            job = self.owned(tenant, job_id)
            if job["status"] not in ACTIVE:
                raise APIError(409, f"The job is {job['status']} and cannot be paused", code="job_not_pausable")
            where = "before its first step"
            if job_id in self.running:
                r, snap = self._take_off_engine(job_id, "paused", "job_not_pausable")
                step = snap.state["step"] if snap is not None else r.step
                if step > 0:
                    where = f"at step {step}"
                    self._checkpoint_at_pause(r, step, snap)
            self._left_queue(job_id)
            self.store.add_event(job_id, f"Fine-tuning job paused {where}")
            return self.store.update_job(job_id, status="paused")

    def resume(self, tenant: str, job_id: str) -> dict:
        """Queue a paused job again; it goes on from the checkpoint its pause left (or the start)."""
        with self._lock:
            job = self.owned(tenant, job_id)
            if job["status"] != "paused":
                raise APIError(409, f"The job is {job['status']}, not paused", code="job_not_paused")
            if self.store.count_jobs(*ACTIVE, tenant=tenant) >= self.config.max_queued_jobs:
                raise APIError(429, f"Too many active fine-tuning jobs (at most {self.config.max_queued_jobs} "
                               "running or queued per tenant)", code="too_many_jobs")
            self.store.add_event(job_id, "Fine-tuning job resumed; it is queued")
            updated = self.store.update_job(job_id, status="queued")
        self._wake.set()
        return updated

    def owned(self, tenant: str, job_id: str) -> dict:
        """``tenant``'s job ``job_id`` (404 when it has none of that id)."""
        return found(self.store.get_job(tenant, job_id), "fine-tuning job", job_id, "fine_tuning_job_id")

    def _take_off_engine(self, job_id: str, becomes: str, code: str
                         ) -> tuple[Running, CheckpointSnapshot | None]:
        """Stop co-serving a running job (cancel or pause): its last steps and checkpoints are recorded and, to
        pause it, it is snapshotted as of its last optimizer step (work on the step in progress is dropped).
        409 with ``code`` if it ended before the engine got to it."""
        r = self.running[job_id]
        if isinstance(r, RFTRunning):
            return self._take_rft_off(r, becomes, code), None

        def stop_and_read():
            try:
                self.engine.cancel_finetune_job(job_id)
            except ValueError:
                pass  # it ended before this reached it: recorded below as it ended, not lost
            else:
                r.job.stop_validation()  # its last step is recorded even if its validation pass was under way
            return self._read(r), r.job.snapshot() if becomes == "paused" else None
        read, snap = self.loop.post_and_wait(stop_and_read)
        status = self._record(r, *read)
        self._forget(job_id)
        if status != "cancelled":
            raise APIError(409, f"The job is already {status} and cannot be {becomes}", code=code)
        return r, snap

    def _take_rft_off(self, r: RFTRunning, becomes: str, code: str) -> RFTRunning:
        """``_take_off_engine`` for a reinforcement job: its run stops (a step under way is dropped; its model
        directory keeps the last whole one) and what it did is recorded."""
        try:
            r.run.cancel()
        except ValueError:
            pass  # it ended before this reached it: recorded below as it ended
        else:
            r.grading.abort()  # a model grader's requests under way end too (the step they grade is dropped)
        r.run.join(STOP_WAIT_S)  # a step that ended just before the cancel is recorded whole
        status = follow_rft(self, r)
        self._forget(r.job_id)
        if status != "cancelled":
            raise APIError(409, f"The job is already {status} and cannot be {becomes}", code=code)
        return r

    def _left_queue(self, job_id: str) -> None:
        """A queued or running job stopped: the queue's head may now fit (it may even have been this job)."""
        self._memory_full = None
        self._told_waiting.discard(job_id)

    def _checkpoint_at_pause(self, r: Running | RFTRunning, step: int, snap: CheckpointSnapshot | None) -> None:
        """The checkpoint a resume starts from: the paused step's, unless the job has one of that step already (a
        reinforcement job resumes from its model directory; its checkpoint is the adapter, to serve)."""
        latest = self.store.latest_checkpoint(r.job_id)
        if latest is not None and latest[0]["step_number"] >= step:
            return
        path = self._checkpoint_dir(r, step)
        if snap is not None:
            write_checkpoint(path, snap)
        else:
            copy_adapter(r.model_dir, path)
        self.record_checkpoint(r, step, path)

    def _hyperparameters(self, body: FineTuningJobRequest, method: str) -> dict:
        """The job's hyperparameters ("auto" resolved), from the top level or the method's object (not both);
        a DPO job's include ``beta``, a reinforcement job's ``compute_multiplier``."""
        given = body.hyperparameters
        prefix = "hyperparameters"
        inner = getattr(body.method, method, None) if body.method is not None else None
        for other in ("supervised", "dpo", "reinforcement"):
            if other != method and body.method is not None and getattr(body.method, other) is not None:
                raise bad_request(f"method.{other}: the method is {method} (give method.{method})", f"method.{other}")
        if inner is not None and inner.hyperparameters:
            if given is not None:
                raise bad_request(f"hyperparameters: give them in method.{method}.hyperparameters or at the top "
                                  "level, not both", "hyperparameters")
            given, prefix = inner.hyperparameters, f"method.{method}.hyperparameters"
        given = given or {"dpo": DpoHyperparameters, "reinforcement": ReinforcementHyperparameters}.get(
            method, Hyperparameters)()
        if getattr(given, "reasoning_effort", "default") != "default":
            raise bad_request(f"{prefix}.reasoning_effort: coserve's models do not reason at set efforts; leave it "
                              "'default'", f"{prefix}.reasoning_effort")
        auto = RFT_AUTO if method == "reinforcement" else AUTO
        out = {}
        for name, (low, high) in LIMITS.items():
            if METHOD_ONLY.get(name, method) != method:
                continue
            value = getattr(given, name, "auto")
            if value == "auto":
                value = auto[name]
            if not low <= value <= high:
                raise bad_request(f"{prefix}.{name}: must be between {low} and {high}, got {value}",
                                  f"{prefix}.{name}")
            out[name] = value
        return out

    def _grader(self, tenant: str, body: FineTuningJobRequest) -> dict:
        """A reinforcement job's grader, checked (400 naming its field)."""
        rft = body.method.reinforcement
        if rft is None:
            raise bad_request("method.reinforcement: a reinforcement job needs its grader "
                              "(method.reinforcement.grader)", "method.reinforcement")
        request_grader(rft.grader, "method.reinforcement.grader", self.config.python_graders,
                       lambda model: self.models.servable(tenant, model))
        return rft.grader

    @staticmethod
    def _response_format(body: FineTuningJobRequest) -> dict:
        """A reinforcement job's ``response_format``, checked as the chat API checks one (400 naming the field)."""
        given = body.method.reinforcement.response_format
        try:
            guided_schema(given)
        except APIError as e:
            raise bad_request(f"method.reinforcement.{e.message}", f"method.reinforcement.{e.param}") from None
        return given

    @staticmethod
    def _evaluation(body: FineTuningJobRequest) -> dict:
        """A reinforcement job's ``eval_interval`` (steps between validations; "auto": at each checkpoint) and
        ``eval_samples`` (completions per validation prompt; "auto": 1), which need a validation file."""
        hyper = body.method.reinforcement.hyperparameters
        out = {"eval_interval": "auto", "eval_samples": 1}
        for name, high in (("eval_interval", 100_000), ("eval_samples", 64)):
            value = getattr(hyper, name) if hyper is not None else "auto"
            if value == "auto":
                continue
            param = f"method.reinforcement.hyperparameters.{name}"
            if body.validation_file is None:
                raise bad_request(f"{param}: the job has no validation_file to evaluate on", param)
            if not 1 <= value <= high:
                raise bad_request(f"{param}: must be between 1 and {high}, got {value}", param)
            out[name] = value
        return out

    def _peft(self, options: CoserveOptions) -> dict:
        try:
            modules = self.engine.model.module_shapes()  # the model's own names (Phi-3's fused ones)
            if options.peft == "ia3":
                if options.target_parameters:
                    raise ValueError("target_parameters: only LoRA adapts experts (as PEFT's IA3 does not)")
                cfg = for_model(IA3Config(**({"target_modules": options.target_modules} if options.target_modules
                                             else default_targets("ia3", modules))), modules)
                return {"peft": "ia3", "target_modules": cfg.target_modules,
                        "feedforward_modules": cfg.feedforward_modules}
            cfg = for_model(LoraConfig(r=options.r, lora_alpha=options.lora_alpha, lora_dropout=options.lora_dropout,
                                       use_rslora=options.use_rslora, use_dora=options.use_dora,
                                       target_parameters=options.target_parameters or [],
                                       **({"target_modules": options.target_modules} if options.target_modules
                                          else default_targets("lora", modules))), modules,
                            self.engine.model.expert_shapes())
        except ValueError as e:
            field = str(e).split(":", 1)[0]
            raise bad_request(f"coserve.{e}", f"coserve.{field}") from e
        rank = max([cfg.r, *cfg.rank_pattern.values()])  # the experts' gate/up at twice r, as PEFT reads gate and up
        if rank > self.engine.config.max_lora_rank:
            raise bad_request(f"coserve.r: {rank} exceeds the server's max_lora_rank "
                              f"({self.engine.config.max_lora_rank}), so the model could not be served", "coserve.r")
        return {"peft": "lora", "r": cfg.r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
                "use_rslora": cfg.use_rslora, "use_dora": cfg.use_dora, "target_modules": cfg.target_modules,
                "target_parameters": cfg.target_parameters, "rank_pattern": cfg.rank_pattern,
                "alpha_pattern": cfg.alpha_pattern}

    # ---- the watcher's side --------------------------------------------------------------------------------
    def _start_queued(self) -> None:
        """Start queued jobs while there is room: next, the oldest job of the tenant running the fewest (so that
        one tenant's many jobs do not hold every slot); none while the memory budget is full."""
        queued = self.store.jobs_with_status("queued")
        per_tenant = Counter(r.tenant for r in self.running.values())
        while queued and len(self.running) < self.config.max_running_jobs:
            if self._memory_full == frozenset(self.running):
                return  # nothing ended since the head of the queue did not fit
            tenant, job = min(queued, key=lambda tj: per_tenant[tj[0]])  # min keeps the oldest among equals
            queued.remove((tenant, job))
            try:
                self._start(tenant, job)
                per_tenant[tenant] += 1
            except WaitForMemory as e:
                self._memory_full = frozenset(self.running)
                if job["id"] not in self._told_waiting:
                    self._told_waiting.add(job["id"])
                    self.store.add_event(job["id"], f"Waiting for finetuning memory: {e}")
                return
            except (ValueError, AdapterError) as e:  # bad data, a job over the memory budget, ...
                self.fail(job["id"], str(e), next((f"invalid_{p}" for p in ("training_file", "validation_file")
                                                   if str(e).startswith(p)), None))
            except OSError as e:  # its message would show the server's paths
                log.exception("starting fine-tuning job %s failed", job["id"])
                self.fail(job["id"], f"the job's files could not be read or written ({e.strerror})", "internal_error")
            except Exception as e:  # a fault of ours: the job fails rather than being retried forever
                log.exception("starting fine-tuning job %s failed", job["id"])
                self.fail(job["id"], f"the job could not start ({type(e).__name__}: {e})", "internal_error")

    def _start(self, tenant: str, job: dict) -> None:
        if job.get("method", {}).get("type") == "reinforcement":
            self._start_rft(tenant, job)
            return
        job_id, opts, hyper = job["id"], job["coserve"], job["hyperparameters"]
        model = self.engine.model
        out = self.jobs_dir / job_id
        method = job.get("method", {}).get("type", "supervised")  # jobs stored before DPO: supervised
        loss = opts.get("dpo_loss", "sigmoid")
        # a DPO job's coserve.dpo_loss may name a reference-free method instead (REFERENCE_FREE)
        kind = "sft" if method != "dpo" else loss if loss in REFERENCE_FREE else "dpo"
        # a job on a fine-tuned model trains on from its adapter, DPO's reference too (jobs stored before: none)
        start = str(self.state_dir / opts["start_from"]) if opts.get("start_from") else ""
        cfg = stored_config(job, out / "model", eval_steps=opts.get("eval_steps", 0),  # jobs stored before: none
                            method=kind, dpo_beta=hyper.get("beta", AUTO["beta"]),
                            dpo_loss=loss if kind == "dpo" else "sigmoid",
                            dpo_label_smoothing=opts.get("dpo_label_smoothing", 0.0) if kind != "sft" else 0.0,
                            simpo_gamma=opts.get("simpo_gamma", 0.5),
                            start_adapter="" if kind == "dpo" else start,
                            dpo_reference=start if kind == "dpo" else "")
        examples, report = self._dataset(job, "training_file", cfg)
        validation = self._dataset(job, "validation_file", cfg)[0] if job["validation_file"] else None
        found = self.store.latest_checkpoint(job_id)
        try:
            if found is not None:
                resume = Path(found[1])
                bypass = load_model_trainable(resume, model)
            elif start:
                resume, bypass = None, starting_bypass(None, model, cfg)
            else:
                resume = None
                p = dict(opts["peft_config"])
                kind = p.pop("peft")
                bypass = make_bypass(IA3Config(**p) if kind == "ia3" else LoraConfig(**p), model, job["seed"])
            ft = new_job(model, bypass, examples, cfg, base_model=self.base_name, resume_from=resume,
                         validation=validation)
        except AdapterError as e:
            if not start:
                raise
            log.warning("fine-tuning job %s: the adapter of %s cannot be read: %s", job_id, job["model"], e)
            raise ValueError(f"model: the adapter of {job['model']} cannot be read") from e
        name = fine_tuned_name(self.base_name, job.get("user_provided_suffix"), job_id)
        r = Running(job_id, tenant, name, self.config.checkpoint_steps or ft.steps_per_epoch, ft,
                    tokens=ft.tokens_done)  # a resumed job's tokens so far are counted already
        ft.on_step = lambda j: self._checkpoint(r)
        at = ft.step  # read before the engine has it: it may train a step before this thread goes on
        try:
            self.loop.post_and_wait(lambda: self.engine.add_finetune_job(ft, job_id=job_id, tenant=tenant))
        except FinetuneMemoryError as e:
            if self.running and e.fits_alone:
                raise WaitForMemory(str(e).removeprefix("finetune_memory_gb: ")) from e
            raise
        self._told_waiting.discard(job_id)
        self.running[job_id] = r
        self.store.update_job(job_id, status="running",
                              coserve={**opts, "step": at, "total_steps": ft.total_steps})
        how = f"resumed at step {at}" if resume else "started"
        if opts.get("start_from"):
            how += f" from {job['model']}"
        kept = job_memory(ft).activation_bytes / 2**20
        held = "a preference pair (two sequences)" if cfg.method in PREFERENCE_METHODS else "a sequence"
        self.store.add_event(job_id, f"Fine-tuning job {how}: {report.summary()}, {ft.total_steps} steps; {held} "
                                     f"keeps up to {kept:.1f} MiB between its forward and backward passes "
                                     f"(rematerialize {cfg.rematerialize}, memory target {cfg.memory_target:g})")

    def _start_rft(self, tenant: str, job: dict) -> None:
        """A reinforcement job: a GRPO run graded by the job's grader, resumed from its last whole step if it had
        one (``rft_jobs.py``)."""
        job_id = job["id"]
        r = start_rft(self, tenant, job, fine_tuned_name(self.base_name, job.get("user_provided_suffix"), job_id),
                      stored_config(job, self.jobs_dir / job_id / "model",
                                    **rft_fields(job, self.config.checkpoint_steps)))
        self._told_waiting.discard(job_id)
        self.running[job_id] = r
        self.store.update_job(job_id, status="running",
                              coserve={**job["coserve"], "step": r.first_step, "total_steps": r.total_steps})
        how = f"resumed at step {r.first_step}" if r.first_step else "started"
        if job["coserve"].get("start_from"):
            how += f" from {job['model']}"
        cfg, grader = r.run.cfg, job["method"]["reinforcement"]["grader"]
        valid = r.run.validation
        every = f"every {cfg.eval_steps} steps" if cfg.eval_steps else "at each epoch's end"
        checked = (f"; {len(valid)} validation prompts x {cfg.eval_samples} completions {every} and after the last "
                   "step") if valid else ""
        self.store.add_event(job_id, f"Reinforcement fine-tuning job {how}: {len(r.run.prompts)} prompts, "
                                     f"{r.total_steps} steps of {r.run.per_step} prompts x {cfg.num_generations} "
                                     f"completions of up to {cfg.max_completion_tokens} tokens, graded by the "
                                     f"{grader['type']} grader '{grader['name']}'{checked}")

    def _dataset(self, job: dict, param: str, cfg: FinetuneConfig):
        """The job's ``param`` file as ``cfg.method`` trains on it (sequences, or preference pairs) and its load
        report; a ValueError naming the file and the lines when any example cannot be used."""
        file_id = job[param]
        path = self.store.file_path(file_id)
        try:
            examples, report = load_training(path, self.engine.tokenizer, cfg)
        except ValueError as e:  # a file with no usable example: named by its id, not by the server's path
            raise ValueError(str(e).replace(str(path), f"{param} {file_id}")) from None
        empty = ("a completion is empty" if cfg.method in PREFERENCE_METHODS
                 else "every assistant message is empty or has weight 0")
        bad = report.malformed + [(n, empty) for n in report.empty_completion]
        if bad:
            named = "; ".join(f"line {n}: {why}" for n, why in sorted(bad)[:_SHOW])
            raise ValueError(f"{param} {file_id}: {len(bad)} example(s) cannot be used: {named}")
        return examples, report

    def _follow(self) -> None:
        running = [r for r in self.running.values() if isinstance(r, Running)]
        ended = [r.job_id for r in self.running.values()
                 if isinstance(r, RFTRunning) and follow_rft(self, r) != "running"]
        if running:
            reads = self.loop.post_and_wait(lambda: [self._read(r) for r in running])  # one engine visit for all
            ended += [r.job_id for r, read in zip(running, reads) if self._record(r, *read) != "running"]
        if ended:
            self._forget(*ended)

    def _record(self, r: Running, status: str, error: str | None, records: list, saved: list, step: int,
                tokens: int) -> str:
        """Record what a job did since the last look (steps, checkpoints) and how it ended if it has (the caller
        then forgets it); returns its status."""
        self.metrics.finetune.add(tokens - r.tokens)
        r.tokens = tokens
        if status != "running":  # no checkpoint comes after this: record those still being written too
            r.wait_for_writes()
            saved, r.saved = saved + r.saved, []
        while r.write_errors:
            self.store.add_event(r.job_id, r.write_errors.pop(0), level="warn")
        for rec in records:
            if not self.store.has_step_event(r.job_id, rec.step):
                valid = rec.valid_loss if rec.valid_loss is not None else rec.valid_batch_loss
                self.store.add_event(r.job_id, f"Step {rec.step}/{r.job.total_steps}: training loss="
                                     f"{rec.loss:.4f}" + (f", validation loss={valid:.4f}" if valid is not None
                                                          else ""),
                                     type="metrics", data={**step_metrics(rec), "learning_rate": rec.lr,
                                                           "tokens": rec.tokens})
        for checkpoint in saved:  # after the events of its steps: a resume from it repeats no step and loses none
            self.record_checkpoint(r, *checkpoint)
        job = self.store.get_job(None, r.job_id)
        self.store.update_job(r.job_id, trained_tokens=r.job.tokens_done,
                              coserve={**job["coserve"], "step": step})
        if status == "succeeded":
            self.succeed(r, self.jobs_dir / r.job_id / "model")
        elif status == "failed":
            self.fail(r.job_id, error or "the job failed", "training_failed")
        return status

    def _read(self, r: Running):
        """On the engine thread: the job's status, and its step records and checkpoints since the last read, taken
        together (a checkpoint read later than the records could be of a step whose record is not among them: a
        crash between the two would lose that step's event on resuming from the checkpoint)."""
        state = self.engine.job_states[r.job_id]
        records = state.job.log[r.logged:]
        r.logged = len(state.job.log)
        saved, r.saved = r.saved, []
        return state.status, state.error, records, saved, state.job.step, state.job.tokens_done

    def _checkpoint(self, r: Running) -> None:
        """On the engine thread, right after an optimizer step: every ``checkpoint_every`` steps (not the last,
        which the finished model is), save the adapter and optimizer state; the watcher records it."""
        j = r.job
        if j.step % r.checkpoint_every or j.step >= j.total_steps:
            return
        path = self._checkpoint_dir(r, j.step)
        r.writes = [w for w in r.writes if not w.done()]  # only this thread changes the list while the job runs
        r.writes.append(self._writer.submit(self._write_checkpoint, r, j.step, path, j.snapshot()))

    def _checkpoint_dir(self, r: Running | RFTRunning, step: int) -> Path:
        return self.jobs_dir / r.job_id / "checkpoints" / f"step-{step}"

    @staticmethod
    def _write_checkpoint(r: Running, step: int, path: Path, snap: CheckpointSnapshot) -> None:
        """On the writer thread: a checkpoint to disk, then into ``r.saved`` for the watcher to record (after the
        events of its steps, which were logged before it was copied). One that fails is told, and training goes
        on: the next checkpoint may land."""
        try:
            write_checkpoint(path, snap)
        except Exception as e:  # told as an event; an OSError's message would show the server's paths
            log.exception("writing checkpoint %s failed", path)
            why = e.strerror if isinstance(e, OSError) else type(e).__name__
            r.write_errors.append(f"The checkpoint at step {step} could not be written ({why}); training goes on")
            return
        r.saved.append((step, path))

    def record_checkpoint(self, r: Running | RFTRunning, step: int, path: Path) -> None:
        ckpt = self.store.add_checkpoint(r.job_id, step, str(path), checkpoint_name(r.name, step),
                                         r.step_metrics(step))
        self.store.add_event(r.job_id, f"Checkpoint created at step {step}: {ckpt['fine_tuned_model_checkpoint']}")

    def succeed(self, r: Running | RFTRunning, model_dir: Path) -> None:
        """A job that finished: its model (in ``model_dir``) is its last checkpoint, and servable."""
        self.record_checkpoint(r, r.step, model_dir)
        self.store.add_event(r.job_id, f"New fine-tuned model created: {r.name}")
        self.store.update_job(r.job_id, status="succeeded", fine_tuned_model=r.name, finished_at=int(time.time()),
                              trained_tokens=r.tokens_done)
        self.store.add_event(r.job_id, "The job has successfully completed")

    def fail(self, job_id: str, message: str, code: str | None) -> None:
        self.store.add_event(job_id, f"Job failed: {message}", level="error")
        self.store.update_job(job_id, status="failed", finished_at=int(time.time()),
                              error={"code": code or "job_failed", "message": message, "param": None})

    def _forget(self, *job_ids: str) -> None:
        """Drop jobs that ended from the engine's and the watcher's books (their files stay on disk)."""
        for job_id in job_ids:
            self.running.pop(job_id, None)
        self.loop.post_and_wait(lambda: [self.engine.job_states.pop(job_id, None) for job_id in job_ids])
