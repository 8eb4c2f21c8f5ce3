"""Prometheus metrics (``GET /metrics``): HTTP requests by status, TTFT and TPOT histograms, the engine's
running and waiting requests, KV cache usage, preemptions, finetuning tokens/s and fine-tuning jobs by state."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
RATE_WINDOW_S = 30.0  # finetuning tokens/s is measured over this much recent time
JOB_STATES = ("validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled")
BATCH_STATES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")


class FinetuneRate:
    """Tokens/s of completed forward+backward over the recent window, from samples of a running total."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self.total = 0

    def add(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.total += tokens
            self._samples.append((now, self.total))
            while len(self._samples) > 2 and now - self._samples[1][0] > RATE_WINDOW_S:
                self._samples.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._samples:
                return 0.0
            start_t, start_total = self._samples[0]
            span = now - start_t
            return (self.total - start_total) / span if span > 0 else 0.0


class _EngineCollector:
    """Gauges read from the engine and the store at scrape time."""

    def __init__(self, engine_state: Callable[[], dict], job_counts: Callable[[], dict], rate: FinetuneRate,
                 batch_counts: Callable[[], dict] | None = None) -> None:
        self.engine_state, self.job_counts, self.rate = engine_state, job_counts, rate
        self.batch_counts = batch_counts

    def collect(self):
        state = self.engine_state()
        for name, doc in (("requests_running", "requests the engine is running"),
                          ("requests_waiting", "requests waiting for admission"),
                          ("kv_cache_usage", "fraction of KV cache blocks in use"),
                          ("adapters_loaded", "adapters loaded in the engine (shared and fine-tuned)")):
            yield GaugeMetricFamily(f"coserve_{name}", doc, value=state[name])
        yield CounterMetricFamily("coserve_preemptions", "requests preempted for KV blocks",
                                  value=state["preemptions"])
        yield CounterMetricFamily("coserve_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                  value=state.get("prefix_cache_queries", 0))
        yield CounterMetricFamily("coserve_prefix_cache_hits", "prompt tokens found in the prefix cache (not "
                                  "computed again)", value=state.get("prefix_cache_hits", 0))
        yield CounterMetricFamily("coserve_spec_decode_draft_tokens", "n-gram draft tokens proposed (speculative "
                                  "decoding)", value=state.get("spec_draft_tokens", 0))
        yield CounterMetricFamily("coserve_spec_decode_accepted_tokens", "draft tokens the model agreed with",
                                  value=state.get("spec_accepted_tokens", 0))
        yield GaugeMetricFamily("coserve_batch_invariant", "1 if an inference row's matmuls round as they would "
                                "without the rows beside it (co-serving cannot change outputs), else 0",
                                value=float(state.get("batch_invariant", True)))
        yield CounterMetricFamily("coserve_failed_iterations", "engine iterations that raised (what raised alone "
                                  "failed; the engine served on)", value=state.get("failed_iterations", 0))
        yield CounterMetricFamily("coserve_finetune_tokens", "finetuning tokens through forward and backward",
                                  value=self.rate.total)
        yield GaugeMetricFamily("coserve_finetune_tokens_per_second",
                                f"finetuning tokens/s over the last {RATE_WINDOW_S:.0f} s", value=self.rate.rate())
        jobs = GaugeMetricFamily("coserve_fine_tuning_jobs", "fine-tuning jobs by state", labels=["state"])
        counts = self.job_counts()
        for s in JOB_STATES:
            jobs.add_metric([s], counts.get(s, 0))
        yield jobs
        if self.batch_counts is not None:
            batches = GaugeMetricFamily("coserve_batches", "batches (the Batch API) by state", labels=["state"])
            counts = self.batch_counts()
            for s in BATCH_STATES:
                batches.add_metric([s], counts.get(s, 0))
            yield batches


class ServerMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, engine_state: Callable[[], dict], job_counts: Callable[[], dict],
                 batch_counts: Callable[[], dict] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.http = Counter("coserve_http_requests", "HTTP requests by route and status",
                            ["method", "route", "status"], registry=self.registry)
        self.generations = Counter("coserve_generation_requests", "generation requests (choices) by outcome",
                                   ["outcome"], registry=self.registry)
        self.ttft = Histogram("coserve_time_to_first_token_seconds", "arrival to first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("coserve_time_per_output_token_seconds", "mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.finetune = FinetuneRate()
        self.registry.register(_EngineCollector(engine_state, job_counts, self.finetune, batch_counts))

    def requests_started(self, n: int = 1) -> None:
        self.generations.labels("started").inc(n)

    def request_done(self, outcome: str, n: int = 1) -> None:
        self.generations.labels(outcome).inc(n)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
