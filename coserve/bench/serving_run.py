"""One (policy, rate) run of ``coserve bench``: an engine driven in real time by a request stream,
with a finetuning job beside it as the policy says.

Policies of the engine's scheduler (``coserve``, ``inference-only``, ``finetune-only``,
``temporal``, ``dts``) run the job inside the engine's iterations. Two baselines run it outside:
``spatial`` trains in a second thread on the same model and cores, with no coordination (on a GPU on a
CUDA stream of its own, as FlexLLM's spatial sharing: two streams share the device), and ``separate``
trains in a second process pinned to its share of the cores while the engine keeps the rest (two
clusters, ``--split``). Each run happens in a fresh process (``run_in_child``) so that threads, core
affinity and allocator state never leak between runs.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from coserve.bench.metrics import RequestRecord, idle_fraction, summarize
from coserve.bench.serving_workload import BenchRequest
from coserve.bench.spawned import context, run_spawned
from coserve.finetune.graph_pruning import DEFAULT_MEMORY_TARGET
from coserve.scheduler.config import DEFAULT_LOAD_RESERVE_S, DEFAULT_SLO_MARGIN, DEFAULT_SLO_MARGIN_MAX
from coserve.scheduler.finetune_work import BACKWARD, FORWARD

ENGINE_POLICIES = ("coserve", "inference-only", "finetune-only", "temporal", "dts")
BENCH_POLICIES = ENGINE_POLICIES + ("spatial", "separate")


@dataclass(slots=True)
class FinetuneSpec:
    """The job every run trains (the same everywhere, so throughputs compare)."""

    data: str  # a dataset file ({text}, Alpaca or chat records)
    max_seq_len: int = 1024
    lora_r: int = 16
    target_modules: tuple[str, ...] = ("down_proj",)
    seed: int = 0
    memory_target: float = DEFAULT_MEMORY_TARGET  # what a sequence keeps between its passes (FinetuneConfig's)


@dataclass(slots=True)
class RunSpec:
    """Everything one run needs; plain data, so it crosses into the child process."""

    model: str
    policy: str  # one of BENCH_POLICIES
    label: str  # how results name it: "temporal:64", "separate 50:50", ...
    rate: float
    duration_s: float
    requests: list[BenchRequest]
    finetune: FinetuneSpec | None
    slo_tpot_ms: float = 50.0
    slo_margin: float = DEFAULT_SLO_MARGIN  # EngineConfig.slo_margin
    slo_margin_max: float = DEFAULT_SLO_MARGIN_MAX  # EngineConfig.slo_margin_max
    load_margin_max: float | None = None  # EngineConfig.load_margin_max
    load_reserve_ms: float = DEFAULT_LOAD_RESERVE_S * 1000  # EngineConfig.load_reserve_ms
    finetune_burst_ms: float | None = None  # EngineConfig.finetune_burst_ms
    first_token_slice_ms: float | None = None  # EngineConfig.first_token_slice_ms
    scheduler_delay_factor: float = 0.0  # EngineConfig.scheduler_delay_factor
    ttft_limit_s: float = 5.0
    drain_s: float = 30.0  # after the last arrival, how long requests may still finish
    temporal_interval: int = 64
    split: tuple[int, int] = (50, 50)  # separate: percent of the cores for inference, finetuning
    dtype: str = "float32"
    device: str | None = None
    max_model_len: int | None = None
    latency_model: str | None = None
    seed: int = 0
    progress: bool = True
    fuse_finetuning: str = "auto"  # EngineConfig.fuse_finetuning
    cuda_graphs: bool = True  # EngineConfig.cuda_graphs
    prefix_caching: bool = True  # EngineConfig.enable_prefix_caching
    cut_for_arrivals: bool = True  # a request arriving mid-iteration cuts its finetuning slice (ModelExecutor.arrivals)
    extra: dict = field(default_factory=dict)  # copied into the result (workload sources, ...)


def split_cores(split: tuple[int, int], cores: list[int]) -> tuple[list[int], list[int]]:
    """The cores for inference and for finetuning: ``split`` percent each, at least one each."""
    if len(cores) < 2:
        raise ValueError(f"separate needs at least 2 cores to split, this process may use {len(cores)}")
    a, b = split
    if a <= 0 or b <= 0:
        raise ValueError(f"split: both shares must be positive, got {a}:{b}")
    n = min(len(cores) - 1, max(1, round(len(cores) * a / (a + b))))
    return cores[:n], cores[n:]


def _make_job(model, tokenizer, spec: FinetuneSpec, out_dir: str):
    """A job with the same data, adapter and seed in every run, long enough never to finish."""
    from coserve.finetune.build import make_bypass
    from coserve.finetune.config import FinetuneConfig
    from coserve.finetune.dataset import load_dataset
    from coserve.finetune.job import FinetuneJob
    from coserve.peft.config import LoraConfig

    cfg = FinetuneConfig(output_dir=out_dir, epochs=1000, max_seq_len=spec.max_seq_len, seed=spec.seed,
                         memory_target=spec.memory_target)
    examples, _ = load_dataset(spec.data, tokenizer, cfg.max_seq_len, cfg.train_on_prompt)
    bypass = make_bypass(LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_r, target_modules=list(spec.target_modules)),
                         model, spec.seed)
    return FinetuneJob(model, bypass, examples, cfg)


def _train_until(job, stop: threading.Event | None, deadline: float | None) -> None:
    """Whole windows, as a standalone trainer runs them, until ``stop`` is set or ``deadline`` passes."""
    while (stop is None or not stop.is_set()) and (deadline is None or time.perf_counter() < deadline):
        kind = job.next_work()
        if kind == "forward":
            job.forward(job.pending_tokens())
        elif kind == "backward":
            job.backward(job.pending_tokens())
        else:
            return


def _train_beside(job, stop: threading.Event) -> None:
    """``spatial``'s training thread: whole windows until ``stop``; on CUDA on a stream of its own, so that its
    kernels may overlap the engine's (which run on the default stream)."""
    import torch
    device = job.model.device
    if device.type != "cuda":
        _train_until(job, stop, None)
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # what the job set up on the default stream is done
    with torch.cuda.stream(stream):
        _train_until(job, stop, None)
    stream.synchronize()


def _separate_worker(conn, model: str, spec: FinetuneSpec, dtype: str, device: str | None, cores: list[int],
                     duration_s: float) -> None:
    """The finetuning side of ``separate``: its own process on its own cores (on a GPU machine, the
    engine's device, shared as two processes share it); reports tokens trained."""
    from coserve.model.batch_invariance import release_strict_cpu_gemms
    release_strict_cpu_gemms()  # a training process serves no inference (before its first matmul)

    import torch

    from coserve.model.config import ModelConfig
    from coserve.model.loader import load_model, resolve_device, resolve_dtype
    from coserve.model.tokenizer import load_tokenizer

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    cfg = ModelConfig.from_dir(model)
    m = load_model(model, resolve_dtype(dtype, cfg), resolve_device(device), max_positions=spec.max_seq_len)
    with tempfile.TemporaryDirectory() as out:
        job = _make_job(m, load_tokenizer(model), spec, out)
        conn.send("ready")
        conn.recv()  # go
        start = time.perf_counter()
        _train_until(job, None, start + duration_s)
        if m.device.type == "cuda":
            torch.cuda.synchronize(m.device)
        conn.send((job.tokens_done, time.perf_counter() - start))


def run_one(spec: RunSpec) -> dict:
    """Drive one run in this process; returns its result row (JSON-ready)."""
    import torch
    from tqdm.auto import tqdm

    from coserve.engine.config import EngineConfig
    from coserve.engine.llm_engine import LLMEngine
    from coserve.scheduler import SamplingParams

    if spec.policy not in BENCH_POLICIES:
        raise ValueError(f"policy: {spec.policy!r} is not one of {', '.join(BENCH_POLICIES)}")
    trains = spec.finetune is not None and spec.policy != "inference-only"  # this run has a finetuning job
    worker = None
    cores = sorted(os.sched_getaffinity(0))
    if trains and spec.policy == "separate":
        inference_cores, finetune_cores = split_cores(spec.split, cores)
        os.sched_setaffinity(0, inference_cores)
        torch.set_num_threads(len(inference_cores))
        ctx = context()
        parent, child = ctx.Pipe()
        worker = ctx.Process(target=_separate_worker, args=(child, spec.model, spec.finetune, spec.dtype,
                                                            spec.device, finetune_cores, spec.duration_s), daemon=True)
        worker.start()
    engine_policy = spec.policy if spec.policy in ENGINE_POLICIES else "inference-only"
    engine = LLMEngine(EngineConfig(
        model=spec.model, dtype=spec.dtype, device=spec.device, max_model_len=spec.max_model_len,
        max_num_seqs=256, policy=engine_policy, slo_tpot_ms=spec.slo_tpot_ms, slo_margin=spec.slo_margin,
        slo_margin_max=spec.slo_margin_max, load_margin_max=spec.load_margin_max,
        load_reserve_ms=spec.load_reserve_ms,
        finetune_burst_ms=spec.finetune_burst_ms, latency_model=spec.latency_model,
        first_token_slice_ms=spec.first_token_slice_ms, scheduler_delay_factor=spec.scheduler_delay_factor,
        temporal_interval=spec.temporal_interval, seed=spec.seed, fuse_finetuning=spec.fuse_finetuning,
        cuda_graphs=spec.cuda_graphs, enable_prefix_caching=spec.prefix_caching))
    _warm_up(engine)
    job, stop, thread = None, threading.Event(), None
    tmp = tempfile.TemporaryDirectory()
    if trains and spec.policy != "separate":
        job = _make_job(engine.model, engine.tokenizer, spec.finetune, tmp.name)
        if spec.policy == "spatial":
            thread = threading.Thread(target=_train_beside, args=(job, stop), daemon=True)
        else:
            engine.add_finetune_job(job, "bench")
    if worker is not None:
        assert parent.recv() == "ready"
        parent.send("go")
    if thread is not None:
        thread.start()

    params = {}
    records: dict[str, RequestRecord] = {}
    pending = deque(sorted(spec.requests, key=lambda r: r.arrival_s))
    unfinished: set[str] = set()
    iterations, busy = [], []
    failed = []
    finetune_tokens, finetune_time = None, None
    num_layers = engine.model_config.num_layers
    bar = tqdm(total=round(spec.duration_s), disable=not spec.progress, leave=False, unit="s",
               desc=f"{spec.label} @ {spec.rate:g} req/s")
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    if spec.cut_for_arrivals:  # as the server's engine loop: a request due waits one window, not the slice
        engine.executor.arrivals = lambda: bool(pending) and pending[0].arrival_s <= clock()
    while True:
        now = clock()
        bar.update(min(round(now), bar.total) - bar.n)
        if finetune_tokens is None and now >= spec.duration_s:
            finetune_tokens, finetune_time = (job.tokens_done if job is not None else 0), now
        while pending and pending[0].arrival_s <= now:
            r = pending.popleft()
            if r.max_tokens not in params:
                params[r.max_tokens] = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
            sp = params[r.max_tokens]
            try:
                rid = engine.add_request(r.prompt, sp)
            except ValueError as e:
                failed.append(RequestRecord(r.arrival_s, None, None, len(r.prompt), 0, failed=True, error=str(e)))
                continue
            records[rid] = RequestRecord(r.arrival_s, None, None, len(r.prompt), 0)
            unfinished.add(rid)
        if now >= spec.duration_s and (not unfinished or now >= spec.duration_s + spec.drain_s):
            break
        if not engine.scheduler.has_work():
            wake = pending[0].arrival_s if pending else spec.duration_s + spec.drain_s
            if now < spec.duration_s:
                wake = min(wake, spec.duration_s)
            time.sleep(max(0.0, min(wake - now, 0.05)))
            continue
        start = clock()
        outs = engine.step()
        end = clock()
        plan = engine.last_plan
        if not plan.is_empty:
            ft_fwd = sum(w.num_tokens for w in plan.finetune if w.kind == FORWARD)
            ft_bwd = sum(w.num_tokens for w in plan.finetune if w.kind == BACKWARD) / num_layers
            iterations.append({"t_s": round(start, 4), "elapsed_s": round(end - start, 5),
                               "predicted_s": round(plan.predicted_s, 5), "decode_tokens": plan.shape.decode_tokens
                               if plan.shape is not None else None,
                               "inference_tokens": plan.num_scheduled_tokens,
                               "finetune_forward_tokens": ft_fwd, "finetune_backward_tokens": round(ft_bwd, 2),
                               "finetune_backward_windows": plan.shape.finetune_backward_windows
                               if plan.shape is not None else None,
                               "margin": round(engine.scheduler.tpot.current_margin(), 4),
                               "load": round(engine.scheduler.tpot.load_share(), 4),
                               "cut": engine.last_cut})
        if plan.chunks:
            busy.append((start, end))
        for out in outs:
            rec = records[out.request_id]
            if rec.first_token_s is None and out.token_ids:
                rec.first_token_s = end
            if out.finished:
                rec.finish_s = end
                rec.num_output_tokens = len(out.token_ids)
                unfinished.discard(out.request_id)
                if out.error is not None:  # the iteration running it failed
                    rec.failed, rec.error = True, out.error
                    failed.append(records.pop(out.request_id))
    bar.close()
    elapsed = clock()
    if thread is not None:
        stop.set()
        thread.join()
    if worker is not None:
        finetune_tokens, finetune_time = parent.recv()
        worker.join()
    tmp.cleanup()
    all_records = list(records.values()) + failed
    # Rates are over the arrival window: at a sustainable load they equal what arrived.
    summary = summarize(all_records, spec.duration_s, spec.slo_tpot_ms / 1000, spec.ttft_limit_s)
    num_requests = len(all_records)
    return {
        "policy": spec.label, "rate": spec.rate, **summary,
        "run_s": elapsed, "duration_s": spec.duration_s, "num_unfinished": len(unfinished),
        "finetune_tokens": finetune_tokens if trains else None,
        "finetune_tokens_per_s": finetune_tokens / finetune_time if trains else None,
        "num_preemptions": engine.scheduler.num_preemptions,
        "kv_preemption_rate": engine.scheduler.num_preemptions / num_requests if num_requests else 0.0,
        "idle_fraction": idle_fraction(busy, spec.duration_s),
        "num_iterations": len(iterations),
        "errors": sorted({r.error for r in failed})[:5],
        "threads": torch.get_num_threads(),
        "finetune_burst_ms": engine.finetune_burst_ms if engine_policy == "coserve" else None,
        "first_token_slice_ms": engine.first_token_slice_ms if engine_policy == "coserve" else None,  # None: no cap
        "cut_for_arrivals": spec.cut_for_arrivals,
        "finetune_memory_target": spec.finetune.memory_target if spec.finetune is not None else None,
        "cut_iterations": sum(1 for it in iterations if it["cut"]),
        "batch_invariant": engine.batch_invariant, "fused_finetuning": engine.executor.fuse_finetuning,
        "gemm_tile_rows": engine.model.gemm_tile_rows, "cuda_graphs": engine.executor.graphs is not None,
        "finetune_stream": None if thread is None else "own" if engine.device.type == "cuda" else "default",
        "iterations": iterations, **spec.extra,
    }


def _warm_up(engine) -> None:
    """One short request end to end, so that first-call costs stay out of the measurement."""
    from coserve.scheduler import SamplingParams
    engine.add_request([engine.tokenizer.bos_token_id or 0] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_in_child(spec: RunSpec) -> dict:
    """``run_one(spec)`` in a fresh (spawned) process."""
    return run_spawned(run_one, spec, f"run {spec.label} @ {spec.rate} req/s")
