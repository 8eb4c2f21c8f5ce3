"""The request stream of one ``coserve bench`` run: arrival times, prompts and output lengths.

Arrivals come from a gamma process (Poisson at burstiness 1) or an Azure trace rescaled to the
target mean rate. Lengths come from a ShareGPT-format trace (prompt text, ``prompt_length``,
``response_length``), else from the Azure trace's token counts, else from a synthetic log-normal;
trace lengths are rescaled to the model's context (``scale_lengths``) and each request is clipped
so that prompt plus output fit it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from coserve.bench.arrivals import gamma_arrivals, load_azure_trace, scale_lengths
from coserve.bench.workload import fit_length, load_sharegpt

SHAREGPT_CONTEXT = 4096  # the context ShareGPT's lengths were collected for (Llama-2 tokens)
AZURE_CONTEXT = 8192  # the Azure trace's


@dataclass(slots=True)
class BenchRequest:
    """One request of a run: when it arrives (seconds after the start), its prompt, and its output length."""

    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Workload:
    """A run's requests and where each part came from (reported with the results)."""

    requests: list[BenchRequest]
    arrivals: str  # "poisson", "gamma(burstiness=B)" or the trace file
    lengths: str  # the prompts file, the trace file, or "synthetic"


def serving_workload(tokenizer, max_model_len: int, rate: float, duration_s: float, *, burstiness: float = 1.0,
                     trace: Path | None = None, prompts: Path | None = None, seed: int = 0,
                     trace_start: int = 0) -> Workload:
    """The requests arriving in ``[0, duration_s)`` at mean ``rate`` req/s (none at rate 0).

    With a trace: ``rate * duration_s`` consecutive requests from request ``trace_start`` on, their
    timestamps scaled to the run (``AzureTrace.segment``).
    """
    if rate < 0:
        raise ValueError(f"rate must be >= 0, got {rate!r}")
    azure = load_azure_trace(trace) if trace is not None else None
    arrivals_name = f"{trace} from request {trace_start}" if trace is not None else ("poisson" if burstiness == 1 else
                                                          f"gamma(burstiness={burstiness})")
    if rate == 0:
        return Workload([], arrivals_name, "none")
    if azure is not None:
        rows = azure.segment(rate, duration_s, trace_start)
        times = [t for t, _, _ in rows]
        trace_lengths = [(c, g) for _, c, g in rows]
    else:
        times = gamma_arrivals(rate, duration_s, burstiness, seed)
        trace_lengths = None
    rng = random.Random(seed)
    n = len(times)
    if prompts is not None:
        entries = load_sharegpt(prompts)
        picked = [entries[i % len(entries)] for i in range(n)]
        texts = [t for t, _, _ in picked]
        prompt_lens = scale_lengths([p for _, p, _ in picked], max_model_len, SHAREGPT_CONTEXT)
        output_lens = scale_lengths([r for _, _, r in picked], max_model_len, SHAREGPT_CONTEXT)
        lengths = str(prompts)
    elif trace_lengths is not None:
        texts = [f"Request {i}: complete the following code." for i in range(n)]
        prompt_lens = scale_lengths([c for c, _ in trace_lengths], max_model_len, AZURE_CONTEXT)
        output_lens = scale_lengths([g for _, g in trace_lengths], max_model_len, AZURE_CONTEXT)
        lengths = str(trace)
    else:  # log-normals shaped like ShareGPT's (prompt median ~40, response median ~240), scaled the same way
        texts = [f"Request {i}: explain the scheduler and its batches." for i in range(n)]
        prompt_lens = scale_lengths([max(1, int(rng.lognormvariate(3.9, 1.4))) for _ in range(n)],
                                    max_model_len, SHAREGPT_CONTEXT)
        output_lens = scale_lengths([max(1, int(rng.lognormvariate(5.3, 0.7))) for _ in range(n)],
                                    max_model_len, SHAREGPT_CONTEXT)
        lengths = "synthetic"
    requests = []
    for t, text, p, o in zip(times, texts, prompt_lens, output_lens):
        p = min(p, max_model_len - 1)
        ids = tokenizer(text, verbose=False)["input_ids"] or [tokenizer.bos_token_id or 0]  # cut to p below
        requests.append(BenchRequest(float(t), fit_length(ids, p), max(1, min(o, max_model_len - p))))
    return Workload(requests, arrivals_name, lengths)
