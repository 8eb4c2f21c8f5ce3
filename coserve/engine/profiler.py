"""``coserve profile``: time real co-serving iterations over a grid and fit the latency model.

Each grid point is one synthetic iteration: decode tokens of sequences with a given context,
a prefill chunk, a finetuning forward window (in the same forward call, as co-serving runs it)
and a finetuning backward window. K/V contents do not matter for timing, so decode sequences
share their prefix blocks and each writes its new token into a block of its own.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from coserve.engine.mixed_forward import FinetuneSlice, mixed_forward
from coserve.finetune.pruned_layer import executor_plan, new_keeps, planned_keeps
from coserve.finetune.sequence_state import SequenceState, new_sequence_state
from coserve.finetune.token_windows import backward_window, forward_window
from coserve.model.attention import PagedKVCache
from coserve.model.decoder import DecoderModel
from coserve.model.forward_batch import SequenceChunk, build_forward_batch
from coserve.model.packed_gemm import gemm_backend
from coserve.peft.config import LoraConfig
from coserve.peft.trainable import TrainableLora
from coserve.scheduler.latency_model import IterationShape, LatencyModel, fit
from coserve.scheduler.slice_policy import layer_windows

BLOCK = 16


@dataclass(slots=True, frozen=True)
class ProfilePoint:
    """One synthetic iteration's token mix."""

    decode_seqs: int  # sequences with one decode token each
    decode_ctx: int  # their context length
    prefill: int  # prompt tokens of one prefill chunk (from position 0)
    ft_forward: int  # finetuning forward window (from position 0)
    ft_backward: int  # finetuning backward token-layers from the end of a ft_context sequence (windows of
    #   at most a layer each, from the last layer down, as the executor runs them)
    ft_context: int  # length of the sequence the backward window belongs to


def grid(num_points: int, max_ctx: int, seed: int = 0, model_layers: int = 3) -> list[ProfilePoint]:
    """``num_points`` points drawn from a grid of decode batches, contexts, prefill and finetuning sizes."""
    rng = random.Random(seed)
    sizes = [n for n in (0, 16, 64, 128, 256, 512) if n <= max_ctx] + ([max_ctx] if max_ctx < 16 else [])
    ctxs = [c for c in (32, 128, 512, 1024, 2048) if c <= max_ctx] or [max_ctx]
    points: set[ProfilePoint] = set()
    for _ in range(num_points * 1000):  # a tiny context has fewer distinct points than asked for
        if len(points) == num_points:
            break
        ft_ctx = rng.choice(ctxs)
        backward = rng.choice(sizes + [ft_ctx + s for s in sizes[1:3]] + [2 * ft_ctx + 16])  # over 1 to 3 layers
        point = ProfilePoint(rng.choice([0, 1, 4, 16, 32, 64]), rng.choice(ctxs), rng.choice(sizes),
                             rng.choice(sizes), min(backward, ft_ctx * min(3, model_layers)), ft_ctx)
        if point.decode_seqs or point.prefill or point.ft_forward or point.ft_backward:
            points.add(point)
    return sorted(points, key=lambda p: (p.decode_seqs, p.decode_ctx, p.prefill, p.ft_forward, p.ft_backward))


class IterationRig:
    """A model, a KV cache of scratch blocks and a finetuning adapter, to time synthetic iterations."""

    def __init__(self, model: DecoderModel, max_ctx: int, max_decode: int = 64, fuse: bool = True) -> None:
        c = model.cfg
        self.model = model
        self.fuse = fuse  # the forward window in the inference rows' calls, as the engine runs it (fuse_finetuning)
        # LoRA on down_proj (on a mixture of experts, whose experts take no adapter: o_proj, the last before it)
        shapes = model.module_shapes()
        target = "down_proj" if "down_proj" in shapes else "o_proj"
        self.bypass = TrainableLora(LoraConfig(r=16, lora_alpha=16, target_modules=[target]), shapes, c.num_layers,
                                    model.device, torch.Generator().manual_seed(0))
        self.shared = -(-max_ctx // BLOCK)  # blocks 0 .. shared-1: the common prefix
        self.cache = PagedKVCache(c.num_layers, self.shared * 2 + max_decode + 1, BLOCK, c.num_kv_heads,
                                  c.head_dim, model.device, model.dtype)
        self.max_decode = max_decode
        self.keep_names = planned_keeps(executor_plan(model, self.bypass.config, "cheap"))

    def _state(self, n: int) -> SequenceState:
        c = self.model.cfg
        ids = torch.randint(5, c.vocab_size, (n,)).tolist()
        state = new_sequence_state(ids, ids[1:] + [-100], c.num_layers, c.hidden_size, c.num_kv_heads, c.head_dim,
                                   self.model.device, self.model.dtype)
        state.keeps = new_keeps(self.model, n, self.keep_names)
        return state

    def _batch(self, p: ProfilePoint):
        chunks, tokens, row = [], [], 0
        nb = -(-p.decode_ctx // BLOCK)
        for s in range(p.decode_seqs):
            table = list(range(nb - 1)) + [2 * self.shared + s]  # shared prefix, own last block
            chunks.append(SequenceChunk(row, row + 1, p.decode_ctx, table))
            tokens.append([7])
            row += 1
        if p.prefill:
            table = list(range(self.shared, self.shared + -(-p.prefill // BLOCK)))
            chunks.append(SequenceChunk(row, row + p.prefill, p.prefill, table))
            tokens.append([7] * p.prefill)
            row += p.prefill
        logits = [c.end - 1 for c in chunks]
        return build_forward_batch(tokens, chunks, BLOCK, logits, self.model.device,
                                   varlen=not self.model.cfg.per_chunk_attention)

    @staticmethod
    def shape(p: ProfilePoint) -> IterationShape:
        """What the scheduler's latency model sees of the point's iteration."""
        n_bwd, ctx = p.ft_backward, p.ft_context
        first = min(n_bwd, ctx)  # the top layer's window, then whole layers, then a partial one
        rest_full, rest_part = divmod(n_bwd - first, ctx)
        windows = layer_windows(n_bwd, ctx, ctx)
        backward_context = (sum(range(ctx - first + 1, ctx + 1)) + rest_full * ctx * (ctx + 1) // 2
                            + sum(range(ctx - rest_part + 1, ctx + 1)))
        return IterationShape(
            decode_tokens=p.decode_seqs, decode_context=p.decode_seqs * p.decode_ctx,
            prefill_tokens=p.prefill, prefill_context=p.prefill * (p.prefill + 1) // 2,
            finetune_forward_tokens=p.ft_forward, finetune_forward_context=p.ft_forward * (p.ft_forward + 1) // 2,
            finetune_backward_token_layers=n_bwd, finetune_backward_context=backward_context,
            finetune_backward_windows=windows)

    def once(self, p: ProfilePoint) -> float:
        """One timed run of the point's iteration (seconds)."""
        model = self.model
        batch = self._batch(p)
        fwd_state = self._state(p.ft_forward) if p.ft_forward else None
        bwd_state = None
        if p.ft_backward:  # forward the whole sequence first (not timed): the backward reads its keeps
            bwd_state = self._state(p.ft_context)
            forward_window(model, self.bypass, bwd_state, p.ft_context, 1.0 / p.ft_context)
        sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        if fwd_state is not None and self.fuse:
            hidden, _ = mixed_forward(model, batch, self.cache, None,
                                      FinetuneSlice(self.bypass, fwd_state, p.ft_forward, 1.0 / p.ft_forward))
        else:
            if batch.num_tokens:
                hidden = model.forward(batch, self.cache, min_rows=model.padded_rows(batch.num_tokens))
            if fwd_state is not None:  # in calls of its own
                forward_window(model, self.bypass, fwd_state, p.ft_forward, 1.0 / p.ft_forward)
        if batch.num_tokens:
            model.logits(hidden[batch.logits_rows]).argmax(-1)
        left = p.ft_backward
        while left > 0:  # window by window across layers, as the executor runs a backward slice
            n = min(left, bwd_state.backward_end)
            backward_window(model, self.bypass, bwd_state, n)
            left -= n
        sync()
        elapsed = time.perf_counter() - start
        self.bypass.zero_grad()
        return elapsed


def profile(model: DecoderModel, key: dict[str, str], num_points: int = 60, repeats: int = 3, seed: int = 0,
            max_ctx: int = 1024, progress=None, fuse: bool = True
            ) -> tuple[LatencyModel, list[tuple[IterationShape, float]]]:
    """Time ``num_points`` grid iterations (forward windows fused into the inference rows' calls or not, as the
    engine will run them) and fit; the model reports its held-out median error.

    The grid is run in ``repeats + 1`` passes (the first a warm-up), each in its own shuffled order, and a point's
    time is its median over the timed passes: a device whose speed drifts while it is profiled (measured on an
    H100: points run in a sorted order showed a block of 40% slower timings) then spreads the drift over all
    kinds of points instead of pinning it on the ones run at the time. ``progress(done, total)`` is called after
    every run."""
    max_ctx = min(max_ctx, model.rope.max_positions)
    rig = IterationRig(model, max_ctx, fuse=fuse)
    points = grid(num_points, max_ctx, seed, model.cfg.num_layers)
    rng = random.Random(seed)
    times: list[list[float]] = [[] for _ in points]
    total, done = len(points) * (repeats + 1), 0
    for timed_pass in range(repeats + 1):
        order = list(range(len(points)))
        rng.shuffle(order)
        for i in order:
            seconds = rig.once(points[i])
            if timed_pass:
                times[i].append(seconds)
            done += 1
            if progress is not None:
                progress(done, total)
    samples = [(rig.shape(p), statistics.median(t)) for p, t in zip(points, times)]
    return fit(samples, key), samples


def save_latency_model(path: Path, latency: LatencyModel) -> None:
    """Add (or replace) ``latency`` in the JSON file at ``path``, keeping models with other keys."""
    from coserve.scheduler.latency_model import STALE_VERSIONS, save_models
    others = []
    if path.is_file():
        raw = json.loads(path.read_text())
        if raw.get("version") not in STALE_VERSIONS:  # an older coserve's file is replaced whole
            others = [LatencyModel.from_json(m) for m in raw.get("models", []) if m.get("key") != latency.key]
    save_models(path, others + [latency])


def latency_key(model_dir: str | Path, device: torch.device, dtype: torch.dtype, fused: bool,
                gemms: str | None = None) -> dict[str, str]:
    """What a fit is valid for: the model directory, device, dtype, thread count, and whether finetuning forward
    windows share the inference rows' matmul calls (``fuse_finetuning``: on a GPU an unfused window costs its own
    kernel launches, so the two fits differ).

    A CUDA device is named with its index (``cuda`` and ``cuda:0`` are one key when 0 is current). ``gemms`` says
    which GEMM library the frozen weights run packed in (``coserve/model/packed_gemm.py``: wherever an engine can,
    it does), which changes what an iteration of few rows costs: the model's own (``DecoderModel.gemms``, which
    ``plan_fusion`` may have changed) where given, else this machine's choice.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return {"model": str(Path(model_dir).resolve()), "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "threads": str(torch.get_num_threads()),
            "fused": str(fused).lower(), "gemms": gemms or _gemms(device, dtype)}


def _gemms(device: torch.device, dtype: torch.dtype) -> str:
    backend = gemm_backend(device, dtype)
    return f"{backend}-packed" if backend is not None else "plain"


def default_profile_path() -> Path:
    """Where profiles go unless told otherwise (``$COSERVE_PROFILE`` or the user cache)."""
    return Path(os.environ.get("COSERVE_PROFILE", Path.home() / ".cache" / "coserve" / "latency.json"))
