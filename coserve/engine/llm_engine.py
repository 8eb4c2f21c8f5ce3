"""The engine: validated requests in, one iteration per ``step()``, RequestOutputs out."""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from coserve.engine.config import DEFAULT_CPU_BURST_MS, DEFAULT_CPU_FIRST_TOKEN_SLICE_MS, EngineConfig
from coserve.engine.executor import ModelExecutor, job_progress
from coserve.engine.job_saver import JobSaver
from coserve.engine.profiler import default_profile_path, latency_key, profile, save_latency_model
from coserve.engine.output_processor import OutputProcessor
from coserve.engine.outputs import RequestOutput
from coserve.kvcache import BlockManager
from coserve.model.attention import PagedKVCache
from coserve.model.batch_invariance import plan_fusion
from coserve.model.config import ModelConfig
from coserve.model.logit_adjust import bad_word_ids
from coserve.model.decode_graphs import DecodeGraphs
from coserve.model.loader import load_model, resolve_device, resolve_dtype
from coserve.model.tokenizer import encode, load_tokenizer
from coserve.peft import (AdapterError, AdapterSlots, IA3Bank, LoraAdapter, LoraBank, ServedAdapter,
                          load_peft_adapter)
from coserve.finetune.chat_format import NOT_UNICODE, is_unicode_text
from coserve.finetune.job import FinetuneJob
from coserve.finetune.memory_budget import job_memory
from coserve.guided.guide import GuidedDecoding
from coserve.guided.vocab import token_bytes
from coserve.scheduler import PoolingParams, Request, SamplingParams, Scheduler, SchedulerConfig
from coserve.scheduler.finetune_work import DONE
from coserve.scheduler.plan import IterationPlan
from coserve.scheduler.sampling_params import truncated_prompt
from coserve.scheduler.latency_model import LatencyModel
from coserve.scheduler.latency_model import load_model as load_latency

log = logging.getLogger("coserve.engine")
BAD_WORDS_KEPT = 256  # distinct bad_words lists whose token ids the engine keeps
BRIEF_PROFILE_POINTS = 25  # iterations timed when a coserve engine has no latency profile (11 features to fit)
BRIEF_PROFILE_CONTEXT = 512  # longest context they use


class FinetuneMemoryError(ValueError):
    """A job that does not fit in ``finetune_memory_gb`` beside the running jobs; ``fits_alone`` says whether it
    would with none running (then it can wait for them)."""

    def __init__(self, message: str, fits_alone: bool) -> None:
        super().__init__(message)
        self.fits_alone = fits_alone


@dataclass(slots=True)
class JobState:
    """A finetuning job and where it ended up."""

    job: FinetuneJob
    status: str = "running"  # running (its final adapter write included), succeeded, failed or cancelled
    error: str | None = None  # why it failed


class LLMEngine:
    """Owns the model, KV cache, adapters, scheduler and executor of one device.

    ``step()`` is the whole loop body: ``plan = scheduler.schedule()``,
    ``result = executor.execute(plan)``, ``scheduler.update(plan, result)``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise ValueError(f"model: {model_dir} is not a directory")
        model_cfg = ModelConfig.from_dir(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_cfg)
        if config.max_model_len is not None and config.max_model_len > model_cfg.max_position_embeddings:
            raise ValueError(f"max_model_len: {config.max_model_len} is more than the model's "
                             f"max_position_embeddings of {model_cfg.max_position_embeddings}")
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        self.model = load_model(model_dir, self.dtype, self.device, max_positions=self.max_model_len)
        self.model_config = model_cfg
        # only the coserve policy runs finetuning windows beside inference rows (the others, whole iterations)
        fusion = plan_fusion(self.model, config.fuse_finetuning if config.policy == "coserve" else "never")
        self.batch_invariant = fusion.batch_invariant  # co-served inference rows round as they would alone
        fuse = fusion.fuse
        self.finetune_burst_ms = (config.finetune_burst_ms if config.finetune_burst_ms is not None
                                  else DEFAULT_CPU_BURST_MS if self.device.type == "cpu" else 0.0)
        ft_slice = (config.first_token_slice_ms if config.first_token_slice_ms is not None
                    else DEFAULT_CPU_FIRST_TOKEN_SLICE_MS if self.device.type == "cpu" else math.inf)
        self.first_token_slice_ms = None if math.isinf(ft_slice) else ft_slice  # None: no cap
        # what a latency fit must match
        self.latency_key = latency_key(config.model, self.device, self.dtype, fuse, self.model.gemms)
        if fusion.violations and config.policy == "coserve":  # a warning unless GEMM tiles fixed it (other policies
            # never put a window beside inference rows: nothing to warn of)
            if fusion.tile_rows:
                how = (f"they run in GEMM tiles of {fusion.tile_rows} rows, so that a finetuning window can share "
                       "them (coserve/model/tiled_gemm.py)")
            elif fusion.repacked:
                how = (f"the frozen weights run packed for {fusion.repacked}, whose rows are, so that a finetuning "
                       "window can share them (coserve/model/batch_invariance.py)")
            elif not fuse:
                how = ("finetuning forward windows run in calls of their own, so that they cannot change an "
                       "inference output (on CPU, set MKL_CBWR=AUTO,STRICT before torch's first matmul: "
                       "coserve/model/batch_invariance.py)")
            else:
                how = ("with fuse_finetuning='always', a concurrent finetuning job may change inference logprobs "
                       "in their last bits")
            log.log(logging.INFO if fusion.tile_rows or fusion.repacked else logging.WARNING,
                    "matmuls here are not batch-invariant (%s): %s", "; ".join(fusion.violations), how)
        num_blocks, storages = self._kv_blocks(model_cfg)
        # decode graphs lay attention out for one variable-length call, which caps no scores: such a model (Gemma 2)
        # runs its decode steps eagerly, laid out per chunk (build_forward_batch's varlen); a mixture of experts too,
        # whose experts' calls take the rows routed to them, a count no recorded graph fixes
        graphed = (config.cuda_graphs and self.device.type == "cuda" and not model_cfg.per_chunk_attention
                   and not model_cfg.moe)
        # with CUDA graphs, one more block than the scheduler hands out: the graphs' dummy rows write there
        self.cache = PagedKVCache(model_cfg.num_layers, num_blocks + graphed, config.block_size,
                                  model_cfg.num_kv_heads, model_cfg.head_dim, self.device, self.dtype,
                                  model_cfg.sliding_layers, storages)
        self.window_storages = storages  # the sliding layers' own pool (0: they keep K/V in the main blocks)
        graphs = (DecodeGraphs(self.model, self.cache, config.max_num_seqs,
                               -(-self.max_model_len // config.block_size)) if graphed else None)
        self.scheduler = self._new_scheduler(num_blocks, self._latency_model())
        self.adapters: dict[str, ServedAdapter] = {}  # servable LoRA and IA3 adapters, by name
        self._installs = itertools.count()
        self._adapter_installs: dict[str, int] = {}  # adapter name -> its latest install (prefix caching's salt)
        shapes = self.model.module_shapes()
        slots = AdapterSlots(LoraBank(shapes, model_cfg.num_layers, config.max_loras, config.max_lora_rank,
                                      self.device, self.dtype, self.model.expert_shapes()),
                             IA3Bank(shapes, model_cfg.num_layers, config.max_loras, self.device))
        self.eos_token_ids = frozenset(self._eos_ids(model_cfg))
        guided = GuidedDecoding(lambda: token_bytes(self.tokenizer, model_cfg.vocab_size), self.eos_token_ids,
                                self.device)
        self.executor = ModelExecutor(self.model, self.cache, slots, self.adapters, config.seed, fuse, graphs, guided,
                                      self.eos_token_ids)
        if graphs is not None:
            try:
                seconds = graphs.record_all()
                log.info("recorded %d CUDA graphs of the decode forward in %.1f s", len(graphs.graphs), seconds)
            except Exception as e:  # a torch or driver that cannot capture: serve eagerly rather than not at all
                log.warning("CUDA graphs could not be recorded (%s: %s); decode iterations run eagerly",
                            type(e).__name__, e)
                self.executor.graphs = None
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._bad_words: dict[tuple[str, ...], list[list[int]]] = {}  # bad_words -> their token ids (``n`` sequences
        #   and repeated requests tokenize them once)
        self._job_ids = itertools.count()
        self.job_states: dict[str, JobState] = {}  # every finetuning job this engine was given, by id
        self.last_plan: IterationPlan | None = None  # the latest iteration's plan (benchmarks read its token mix)
        self.last_cut = False  # whether the latest iteration cut its finetuning slice short for an arrival
        self._last_step: tuple[float, float] | None = None  # (start, model seconds) of the latest busy iteration
        self.num_failed_iterations = 0  # iterations that raised (``_iteration_failed``; or a forward run apart)
        self.saver = JobSaver()  # finished jobs' adapters, written off the engine thread

    # ---- finetuning jobs -----------------------------------------------------
    def add_finetune_job(self, job: FinetuneJob, job_id: str | None = None, tenant: str = "default") -> str:
        """Co-serve ``job`` (of ``tenant``, for fairness) from the next iteration on; returns its id."""
        jid = job_id if job_id is not None else f"ftjob-{next(self._job_ids)}"
        if jid in self.job_states:
            raise ValueError(f"job_id: {jid!r} is already in use")
        self._check_finetune_memory(job)
        self._ensure_latency_model()
        self.job_states[jid] = JobState(job)
        if job.write_later is None:  # numbered checkpoints (save_steps) are written off the engine thread
            job.write_later = self.saver.write_later
        self.executor.jobs[jid] = job
        self.scheduler.add_job(job_progress(jid, job), tenant)
        if job.done:
            self._finish_job(jid, None)
        return jid

    def finetune_memory_in_use(self) -> int:
        """Bytes the running jobs hold (``job_memory``)."""
        return sum(job_memory(s.job).total_bytes for s in self.job_states.values() if s.status == "running")

    def _check_finetune_memory(self, job: FinetuneJob) -> None:
        if self.config.finetune_memory_gb is None:
            return
        budget = int(self.config.finetune_memory_gb * 2**30)
        need, used = job_memory(job), self.finetune_memory_in_use()
        if used + need.total_bytes > budget:
            raise FinetuneMemoryError(f"finetune_memory_gb: the job needs {need.total_bytes / 2**20:.1f} MiB (adapter and "
                             f"optimizer {need.adapter_bytes / 2**20:.1f}, activations {need.activation_bytes / 2**20:.1f});"
                             f" {used / 2**20:.1f} of {budget / 2**20:.1f} MiB are in use by running jobs",
                             fits_alone=need.total_bytes <= budget)

    def cancel_finetune_job(self, job_id: str) -> None:
        """Stop a running job; its last saved checkpoint (if any) stays. Refused for a finished job."""
        state = self.job_states.get(job_id)
        if state is None:
            raise ValueError(f"job_id: {job_id!r} is not known")
        if state.status != "running":
            raise ValueError(f"job {job_id!r} is already {state.status}")
        self.scheduler.remove_job(job_id)
        self.executor.jobs.pop(job_id, None)
        state.status = "cancelled"

    def has_running_jobs(self) -> bool:
        return any(s.status == "running" for s in self.job_states.values())

    def _finish_job(self, job_id: str, error: str | None) -> None:
        """A job's last step ran (or it failed): off the scheduler; one that trained has its adapter written off
        this thread (``JobSaver``) and stays ``running`` until ``collect_saves`` sees the write end."""
        state = self.job_states[job_id]
        self.scheduler.remove_job(job_id)
        self.executor.jobs.pop(job_id, None)
        if error is None:
            self.saver.submit(job_id, state.job)
        else:
            state.status, state.error = "failed", error

    def saves_ended(self) -> bool:
        """Whether a finished job's adapter write has ended and awaits ``collect_saves`` (any thread)."""
        return self.saver.any_done()

    def collect_saves(self) -> bool:
        """Jobs whose adapter write ended succeed (or fail, naming why); True if any did. ``step`` calls it."""
        ended = self.saver.collect()
        for job_id, error in ended.items():
            state = self.job_states.get(job_id)
            if state is not None and state.status == "running":  # not cancelled meanwhile
                state.status, state.error = ("failed", error) if error else ("succeeded", None)
        return bool(ended)

    # ---- adapters ------------------------------------------------------------
    def load_adapter(self, name: str, path: str | Path) -> None:
        """Make a HF PEFT LoRA or IA3 adapter directory servable under ``name``; checked against the model first.

        The kind is the ``peft_type`` of its ``adapter_config.json``; a batch may mix both kinds and the base.
        """
        self.install_adapter(self.read_adapter(name, path))

    def read_adapter(self, name: str, path: str | Path) -> ServedAdapter:
        """Read and check an adapter directory (any thread: it touches nothing the iterations use)."""
        if not name or not isinstance(name, str):
            raise AdapterError(f"adapter name must be a non-empty string, got {name!r}")
        adapter = load_peft_adapter(name, path, self.model.module_shapes(), self.model_config.num_layers,
                                    self.model.module_weight, self.model.expert_shapes())
        if isinstance(adapter, LoraAdapter) and adapter.rank > self.config.max_lora_rank:
            raise AdapterError(f"{path}: r={adapter.rank} exceeds max_lora_rank={self.config.max_lora_rank}")
        return adapter

    def install_adapter(self, adapter: ServedAdapter) -> None:
        """Serve an adapter from ``read_adapter`` under its name (between iterations), replacing one so named."""
        self.executor.slots.evict(adapter.name)  # replacing an adapter of the same name (of either kind)
        self.adapters[adapter.name] = adapter
        self._adapter_installs[adapter.name] = next(self._installs)  # K/V cached under the old one no longer match

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; refused while requests still use it."""
        if name not in self.adapters:
            raise AdapterError(f"adapter {name!r} is not loaded")
        users = [r.request_id for r in self.scheduler.requests.values()
                 if r.adapter == name and not r.is_finished]
        if users:
            raise AdapterError(f"adapter {name!r} is in use by {len(users)} request(s)")
        self.executor.slots.evict(name)
        del self.adapters[name]

    # ---- requests ------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams, adapter: str | None = None,
                     request_id: str | None = None, tenant: str = "default",
                     priority: int = 0) -> tuple[Request, str | None]:
        """Validate and tokenize one request without queueing it; raises ValueError naming the field.
        ``priority``: lower is served first under the priority scheduling policy (any value but 0 is an
        error under fcfs, as in vLLM, rather than silently ignored). With ``PoolingParams`` it is an embedding
        request: its output is the prompt's embedding (``RequestOutput.embedding``), and no token is generated."""
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:  # it runs as a prompt whose one token is never sampled
            params = SamplingParams(max_tokens=1, temperature=0.0,
                                    truncate_prompt_tokens=pooling.truncate_prompt_tokens)
            if pooling.dimensions is not None and pooling.dimensions > self.model_config.hidden_size:
                raise ValueError(f"dimensions: {pooling.dimensions} is more than the model's "
                                 f"{self.model_config.hidden_size}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
        if params.n != 1:  # one sequence per engine request: LLM.generate (or the server) makes n of them
            raise ValueError(f"n: {params.n} sequences need {params.n} requests (LLM.generate makes them)")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority: {priority} needs the priority scheduling policy (this engine schedules "
                             f"{self.config.scheduling_policy})")
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"adapter: {adapter!r} is not loaded (loaded: {sorted(self.adapters)})")
        vocab = self.model_config.vocab_size
        if params.bad_words and params.bad_words_token_ids is None:
            key = tuple(params.bad_words)
            if key not in self._bad_words:
                if len(self._bad_words) >= BAD_WORDS_KEPT:
                    self._bad_words.clear()
                self._bad_words[key] = bad_word_ids(self.tokenizer, params.bad_words)
            params = replace(params, bad_words_token_ids=self._bad_words[key])
        for field, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ()),
                           ("stop_token_ids", params.stop_token_ids),
                           ("bad_words_token_ids", [t for s in params.bad_words_token_ids or () for t in s])):
            outside = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if outside:
                raise ValueError(f"{field}: token id {outside[0]} is outside the vocabulary [0, {vocab})")
        for field in ("logprobs", "prompt_logprobs"):  # the top-N of more than the vocabulary fails its iteration
            n = getattr(params, field)
            if n is not None and n > vocab:
                raise ValueError(f"{field}: {n} is more than the vocabulary's {vocab} tokens")
        if isinstance(prompt, str) and not is_unicode_text(prompt):  # the tokenizer's TypeError names nothing
            raise ValueError(f"prompt: {NOT_UNICODE}")
        if isinstance(prompt, str):
            text, token_ids = prompt, encode(self.tokenizer, prompt)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt: token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt: is empty")
        kept = truncated_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        if len(kept) < len(token_ids):
            text, token_ids = None, kept  # the text is no longer the tokens'
        if pooling is not None and len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens are more than max_model_len={self.max_model_len}")
        if pooling is None and len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens leave no room to generate within "
                             f"max_model_len={self.max_model_len}")
        blocks = self.scheduler.blocks
        need = len(token_ids) if pooling is not None else min(len(token_ids) + params.max_tokens, self.max_model_len)
        held = blocks.most_held(need)  # every layer sliding: a window's span at once
        if held > blocks.num_blocks:
            raise ValueError(f"prompt: {len(token_ids)} tokens plus max_tokens={params.max_tokens} need {held} KV "
                             f"blocks of {blocks.block_size} tokens at once; the whole cache holds {blocks.num_blocks}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests:
            raise ValueError(f"request_id: {rid!r} is already in use")
        request = Request(rid, list(token_ids), params, adapter, self.eos_token_ids, time.monotonic(), tenant=tenant,
                          cache_salt=f"{tenant}\x00{adapter}\x00{self._adapter_installs.get(adapter, '')}",
                          priority=priority, pooling=pooling)
        return request, text

    def add_request(self, prompt: str | list[int], params: SamplingParams, adapter: str | None = None,
                    request_id: str | None = None, tenant: str = "default", priority: int = 0) -> str:
        """Validate, tokenize and queue a request; returns its id. Other requests are unaffected by errors."""
        request, text = self.make_request(prompt, params, adapter, request_id, tenant, priority)
        self.enqueue(request, text)
        return request.request_id

    def enqueue(self, request: Request, text: str | None) -> None:
        """Queue a request built by ``make_request``."""
        self.scheduler.add_request(request)
        self.outputs.add(request, text)

    def _new_scheduler(self, num_blocks: int, latency: LatencyModel | None) -> Scheduler:
        c = self.config
        return Scheduler(SchedulerConfig(c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len, c.max_loras,
                                         c.policy, c.slo_tpot_ms / 1000, slo_margin=c.slo_margin,
                                         slo_margin_max=c.slo_margin_max, load_margin_max=c.load_margin_max,
                                         load_reserve_s=c.load_reserve_ms / 1000,
                                         finetune_burst_s=self.finetune_burst_ms / 1000,
                                         first_token_slice_s=(None if self.first_token_slice_ms is None
                                                              else self.first_token_slice_ms / 1000),
                                         temporal_interval=c.temporal_interval,
                                         speculative_tokens=c.speculative_tokens,
                                         scheduling_policy=c.scheduling_policy,
                                         scheduler_delay_factor=c.scheduler_delay_factor,
                                         long_rope_from=self.model.long_rope_from),
                         BlockManager(num_blocks, c.block_size, c.enable_prefix_caching, self.window_storages,
                                      self.model_config.kv_window or (self.model_config.pooled_window
                                                                      if self.window_storages else None)),
                         latency=latency)

    def reset_after_fault(self, error: BaseException) -> list[RequestOutput]:
        """After ``step`` raised outside the model work (the scheduler's own bookkeeping: its state can no longer
        be trusted): every request and job in the engine fails, naming the error, and the engine starts over
        with an empty scheduler (KV blocks all free); adapters, model and cache stay. Returns the requests' final
        outputs (``finish_reason`` "error")."""
        message = f"{type(error).__name__}: {error}"
        log.error("the engine's bookkeeping failed; failing every request and job and starting over: %s", message,
                  exc_info=error)
        outputs = []
        for request in list(self.scheduler.requests.values()):
            request.error, request.finish_reason = message, "error"
            outputs.append(self.outputs.output(request, True))
        for job_id, state in self.job_states.items():
            if state.status == "running":
                self.executor.jobs.pop(job_id, None)
                state.status, state.error = "failed", f"the engine failed ({message})"
        self.scheduler = self._new_scheduler(self.scheduler.blocks.num_blocks, self.scheduler.latency)
        self.outputs = OutputProcessor(self.tokenizer)
        self.executor.generators.clear()
        self.executor.guided.release_all()
        self._last_step = None
        self.num_failed_iterations += 1
        return outputs

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of requests that got a token or finished."""
        start = time.perf_counter()
        self.collect_saves()
        if self._last_step is not None:  # back to back with a busy one: the gap beyond its model work is overhead
            last_start, last_model_s = self._last_step
            self.scheduler.tpot.observe_overhead(start - last_start - last_model_s)
        plan = self.scheduler.schedule()
        try:
            result = self.executor.execute(plan)
        except Exception as e:  # what the iteration carried fails; the engine keeps serving
            return self._iteration_failed(plan, e)
        self.last_plan, self.last_cut = plan, result.interrupted
        if result.forward_error is not None:  # its parts ran again apart (logged): counted, though it stood
            self.num_failed_iterations += 1
        events = self.scheduler.update(plan, result)
        for progress in result.finetune:
            if progress.phase == DONE and self.job_states[progress.job_id].status == "running":
                self._finish_job(progress.job_id, result.finetune_errors.get(progress.job_id))
        outputs = []
        for event in events:
            request = self.scheduler.requests[event.request_id]
            if self.outputs.process(request, event):
                self.scheduler.finish_request(request.request_id, "stop")
            outputs.append(self.outputs.output(request, request.is_finished))
            if request.is_finished:
                self.scheduler.pop_request(request.request_id)
        for request_id in [*plan.finished, *result.request_errors]:  # aborted and failed ones: a final output too
            request = self.scheduler.pop_request(request_id)
            if request is not None:
                outputs.append(self.outputs.output(request, True))
        # Only iterations that serve requests and follow each other measure the overhead (not an idle wait).
        self._last_step = (start, result.elapsed_s) if self.scheduler.has_unfinished() else None
        return outputs

    def _iteration_failed(self, plan: IterationPlan, error: Exception) -> list[RequestOutput]:
        """An iteration raised past the executor's own recovery (a forward or an LM head call that raises is run
        again in parts by the executor, and sampling row by row; what is left is a bug): fail what it carried and
        go on.

        Jobs are the suspects first: a plan with finetuning work fails its jobs (their state may be half-advanced)
        and leaves its requests as they were before it (the scheduler's ``update`` never ran), so the next
        iteration runs their tokens again, rewriting the same KV slots. A plan of requests alone fails them with
        ``finish_reason`` "error". Requests and jobs it did not carry are untouched."""
        message = f"{type(error).__name__}: {error}"
        self.num_failed_iterations += 1
        log.error("iteration %d failed: %s", plan.step, message, exc_info=error)
        if self.device.type == "cuda" and isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        self._last_step = None
        self.last_plan = plan
        outputs = []
        jobs = {w.job_id for w in plan.finetune}
        for job_id in sorted(jobs):
            if self.job_states[job_id].status == "running":
                self._finish_job(job_id, f"an iteration running this job failed ({message})")
        if not jobs:
            for chunk in plan.chunks:
                request = self.scheduler.requests.get(chunk.request_id)
                if request is not None and not request.is_finished:
                    request.error = message
                    self.scheduler.finish_request(request.request_id, "error")
        for request_id in plan.finished + [c.request_id for c in plan.chunks]:
            request = self.scheduler.pop_request(request_id)
            if request is not None:
                outputs.append(self.outputs.output(request, True))
        return outputs

    def _latency_path(self) -> Path:
        return Path(self.config.latency_model) if self.config.latency_model else default_profile_path()

    def _latency_model(self) -> LatencyModel | None:
        """The profiled latency model that fits this engine (``latency_key``), if any."""
        path = self._latency_path()
        try:
            return load_latency(path, self.latency_key)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"latency_model: {path} cannot be read ({e})") from e

    def _ensure_latency_model(self) -> None:
        """Under the coserve policy, profile briefly when no latency model fits (FlexLLM sizes slices by one)."""
        if self.scheduler.latency is not None or self.config.policy != "coserve" or not self.config.auto_profile:
            return
        key = self.latency_key
        start = time.perf_counter()
        latency, _ = profile(self.model, key, num_points=BRIEF_PROFILE_POINTS, repeats=1,
                             max_ctx=min(BRIEF_PROFILE_CONTEXT, self.max_model_len),
                             fuse=self.executor.fuse_finetuning)
        path = self._latency_path()
        try:
            save_latency_model(path, latency)
        except OSError as e:  # the fit still serves this engine
            log.warning("could not save the latency profile to %s: %s", path, e)
        err = latency.heldout_median_abs_pct_error
        log.warning("no latency profile fitted %s; profiled %d iterations in %.1f s (held-out median error %s); "
                    "saved to %s (run `coserve profile` for a fuller one)", key, BRIEF_PROFILE_POINTS,
                    time.perf_counter() - start, "n/a" if err is None else f"{err:.1f}%", path)
        self.scheduler.latency = latency

    def _kv_blocks(self, cfg: ModelConfig) -> tuple[int, int]:
        """The main pool's blocks (``num_kv_blocks``, else as many as ``kv_cache_memory_gb`` holds, but no more
        than every running request holds at full length, or, where every layer slides, within its window) and, for
        a model whose sliding layers sit beside whole-context ones, their own pool's storages: as many as the
        running requests' windows and one iteration's new tokens can read (each request at most
        ``ceil((window - 1) / block_size) + 2`` blocks besides its new tokens'), where that is fewer than the main
        blocks (else, or with ``disable_hybrid_kv_cache_manager``, 0: those layers keep K/V in the main blocks)."""
        c = self.config

        def windows_of(window: int) -> int:  # the most blocks the running requests read within their windows
            per_request = -(-(window - 1) // c.block_size) + 2
            return c.max_num_seqs * per_request + -(-c.max_num_batched_tokens // c.block_size)

        by_use = -(-c.max_num_seqs * self.max_model_len // c.block_size)
        if cfg.kv_window is not None:  # every layer slides: requests give up the blocks behind their windows
            by_use = min(by_use, windows_of(cfg.kv_window))
        window = None if c.disable_hybrid_kv_cache_manager else cfg.pooled_window
        demand = 0 if window is None else windows_of(window)

        def per_block(layers: int) -> int:
            return PagedKVCache.bytes_per_block(layers, c.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)

        if c.num_kv_blocks:
            blocks = c.num_kv_blocks
        else:
            memory = int(c.kv_cache_memory_gb * 2**30)
            blocks = max(1, min(memory // per_block(cfg.num_layers), by_use))
            if window is not None:
                sliding = len(cfg.sliding_layers)
                pooled = (memory - demand * per_block(sliding)) // per_block(cfg.num_layers - sliding)
                if pooled > demand:
                    blocks = min(pooled, by_use)
        storages = demand if window is not None and demand < blocks else 0
        return blocks, storages

    def _eos_ids(self, cfg: ModelConfig) -> set[int]:
        ids = set(cfg.eos_token_ids)
        gen_cfg = Path(self.config.model) / "generation_config.json"
        if gen_cfg.is_file():
            try:
                raw = json.loads(gen_cfg.read_text()).get("eos_token_id")
            except json.JSONDecodeError as e:
                raise ValueError(f"{gen_cfg}: not valid JSON ({e})") from e
            ids.update(raw if isinstance(raw, list) else [raw] if raw is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids
