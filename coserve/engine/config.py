"""The engine's one configuration object, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.model.batch_invariance import FUSE_CHOICES
from coserve.scheduler.config import (DEFAULT_LOAD_RESERVE_S, DEFAULT_SLO_MARGIN, DEFAULT_SLO_MARGIN_MAX,
                                     SCHEDULING_POLICIES, check_delay_factor, check_load_reserve, check_margins)


# The finetuning burst on a CPU (EngineConfig.finetune_burst_ms). The session that built it measured 27-32% more
# finetuning with 100 ms bursts than with a slice in every iteration, co-served at 1 and 3 req/s on a 2-core Zen 4
# EPYC (its runs are lost); on a 2-core Zen 5 EPYC, twice as fast, at 1-3 req/s, within noise
# (docs/benchmark-history.md).
DEFAULT_CPU_BURST_MS = 100.0
# The first-token slice on a CPU (EngineConfig.first_token_slice_ms): the finetuning left out of an iteration that
# gives a request its first token is banked as the running requests' TPOT slack, which the bursts above spend.
# Measured on a 2-core Zen 5 EPYC, co-serving the sweep's workload, 5 ms against none, one pair each at 1, 2, 3
# and 5 req/s (two at 5): TTFT p50 0-16 ms lower, finetuning 0-6% higher (docs/benchmark-history.md).
DEFAULT_CPU_FIRST_TOKEN_SLICE_MS = 5.0


@dataclass(slots=True)
class EngineConfig:
    """Everything needed to start an engine; errors name the field."""

    model: str  # a Hugging Face model directory
    dtype: str = "auto"  # auto (the checkpoint's), float32, bfloat16, float16
    device: str | None = None  # None = cuda when available, else cpu
    max_model_len: int | None = None  # None = the model's max_position_embeddings (no more is accepted)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None = as many as kv_cache_memory_gb holds
    kv_cache_memory_gb: float = 1.0  # memory for the KV cache when num_kv_blocks is None
    max_num_batched_tokens: int = 2048  # new tokens per iteration
    max_num_seqs: int = 128  # requests running at once
    max_loras: int = 4  # distinct adapters in one batch (device slots)
    max_lora_rank: int = 16  # largest adapter rank the slots hold
    seed: int = 0  # seed for requests that sample without their own seed
    policy: str = "coserve"  # how finetuning jobs share iterations (scheduler.config.POLICIES)
    temporal_interval: int = 64  # policy temporal: inference iterations per finetuning iteration
    slo_tpot_ms: float = 50.0  # inference time-per-output-token target the finetuning slice respects
    slo_margin: float = DEFAULT_SLO_MARGIN  # fraction of the TPOT SLO kept free for prediction error (the
    #   iteration target is slo_tpot_ms * (1 - margin)); the least margin
    slo_margin_max: float = DEFAULT_SLO_MARGIN_MAX  # the most margin: the scheduler raises it while finished
    #   requests miss the SLO and as the inference load grows (SchedulerConfig.slo_margin_max); equal to
    #   slo_margin = a fixed margin
    load_margin_max: float | None = None  # the most the inference load alone raises the margin to; above it only
    #   misses do (SchedulerConfig.load_margin_max; None: slo_margin_max)
    load_reserve_ms: float = DEFAULT_LOAD_RESERVE_S * 1000  # the most TPOT slack the load margin makes a request
    #   bank before it goes at the target without it (SchedulerConfig.load_reserve_s; inf: no cap)
    finetune_burst_ms: float | None = None  # coserve: with requests decoding, finetuning waits until their banked
    #   TPOT slack allows a slice this long (SchedulerConfig.finetune_burst_s); 0 = every iteration carries one;
    #   None = DEFAULT_CPU_BURST_MS on a CPU (where a slice beside decode tokens costs what it costs alone, and
    #   small slices more per token), 0 on a GPU (where it rides nearly free)
    first_token_slice_ms: float | None = None  # coserve: the most finetuning an iteration that gives a request its
    #   first token carries (SchedulerConfig.first_token_slice_s); inf = as any other iteration; None =
    #   DEFAULT_CPU_FIRST_TOKEN_SLICE_MS on a CPU (with its bursts), inf on a GPU (whose slices ride nearly free)
    latency_model: str | None = None  # `coserve profile` JSON; None = the default profile path. A fit for this
    #   model, device, dtype and thread count sizes finetuning slices
    finetune_memory_gb: float | None = None  # finetuning jobs' adapters, gradients, optimizer state and kept
    #   activations together (a job that would exceed it is refused); None = no limit
    auto_profile: bool = True  # policy coserve: profile briefly (and save to latency_model's path) when the first
    #   finetuning job arrives and no fit exists; False = size slices by the token budget instead
    fuse_finetuning: str = "auto"  # run a finetuning forward window in the inference rows' matmul calls: "auto" =
    #   when the device's matmuls are batch-invariant (so it cannot change an inference output), "always", "never"
    cuda_graphs: bool = True  # on CUDA, decode-only iterations replay recorded CUDA graphs (model/decode_graphs.py)
    speculative_tokens: int = 0  # speculative decoding (n-gram lookup, vLLM's "ngram" method): drafts verified per
    #   decode step of a greedy request without per-token options (scheduler/ngram_drafts.py); 0 = off
    enable_prefix_caching: bool = True  # full KV blocks are shared by requests whose tokens (and tenant and
    #   adapter) agree up to them (kvcache/block_manager.py); a prompt's cached blocks are not computed again
    disable_hybrid_kv_cache_manager: bool = False  # vLLM's flag: the sliding layers of a model that mixes them with
    #   whole-context ones keep their K/V in the main blocks, not in a pool of their own (kvcache/window_pool.py)
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (requests' priority: lower first; vLLM's flag)
    scheduler_delay_factor: float = 0.0  # vLLM's: while requests run, new prompts wait until the oldest has waited
    #   this many times the last prompt iteration's latency, so that several share one prefill pass; 0 = off

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_loras", "max_lora_rank",
                    "temporal_interval")
        if (not isinstance(self.speculative_tokens, int) or isinstance(self.speculative_tokens, bool)
                or self.speculative_tokens < 0):
            raise ValueError(f"speculative_tokens must be a non-negative integer, got {self.speculative_tokens!r}")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.finetune_memory_gb is not None and not self.finetune_memory_gb > 0:
            raise ValueError(f"finetune_memory_gb must be positive or None, got {self.finetune_memory_gb!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.fuse_finetuning not in FUSE_CHOICES:
            raise ValueError(f"fuse_finetuning must be one of {FUSE_CHOICES}, got {self.fuse_finetuning!r}")
        check_margins(self.slo_margin, self.slo_margin_max, self.load_margin_max)
        check_load_reserve(self.load_reserve_ms, "load_reserve_ms")
        check_delay_factor(self.scheduler_delay_factor)
        for name, what in (("first_token_slice_ms", "None or a non-negative number (inf: no cap)"),
                           ("finetune_burst_ms", "a non-negative number")):  # None: the device's default
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not value >= 0):
                raise ValueError(f"{name} must be {what}, got {value!r}")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb!r}")
