"""The torch side of an iteration: IterationPlan in, ExecutionResult out."""

from __future__ import annotations

import time

import torch

from coserve.model.attention import PagedKVCache
from coserve.model.decoder import DecoderModel
from coserve.model.forward_batch import SequenceChunk, build_forward_batch
from coserve.model.sampling import SamplingRow, sample, top_logprobs
from coserve.peft import LoraAdapter, LoraBank
from coserve.scheduler.plan import ExecutionResult, IterationPlan, TokenLogprobs


class ModelExecutor:
    """Runs plans on one device: builds the flat batch, runs the model, samples."""

    def __init__(self, model: DecoderModel, cache: PagedKVCache, bank: LoraBank,
                 adapters: dict[str, LoraAdapter], seed: int) -> None:
        self.model = model
        self.cache = cache
        self.bank = bank
        self.adapters = adapters  # the engine's resident adapters, by name (shared, read only here)
        self.generators: dict[str, torch.Generator] = {}  # per-request RNGs of seeded requests
        self.default_generator = torch.Generator(device=model.device).manual_seed(seed)

    def execute(self, plan: IterationPlan) -> ExecutionResult:
        """Run one iteration's chunks in one forward call and sample where the plan asks."""
        for request_id in plan.finished:
            self.generators.pop(request_id, None)
        if plan.is_empty:
            return ExecutionResult()
        start_time = time.perf_counter()
        batch = self._forward_batch(plan)
        lora = self._lora_batch(plan, batch.num_tokens) if plan.adapters else None
        hidden = self.model.forward(batch, self.cache, lora)
        sampling = [c for c in plan.chunks if c.sample]
        result = ExecutionResult()
        if sampling:
            logits = self.model.logits(hidden[batch.logits_rows])  # [N, V] float32
            rows = [SamplingRow(c.params.temperature, c.params.top_k, c.params.top_p,
                                self._generator(c.request_id, c.params.seed)) for c in sampling]
            tokens = sample(logits, rows, self.default_generator)
            result.sampled = {c.request_id: t for c, t in zip(sampling, tokens)}
            wants = [i for i, c in enumerate(sampling) if c.params.logprobs is not None]
            if wants:
                lp = top_logprobs(logits[wants], [tokens[i] for i in wants],
                                  [sampling[i].params.logprobs for i in wants])
                for i, (chosen, top) in zip(wants, lp):
                    result.logprobs[sampling[i].request_id] = TokenLogprobs(tokens[i], chosen, top)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        result.elapsed_s = time.perf_counter() - start_time
        return result

    def _forward_batch(self, plan: IterationPlan):
        chunks, tokens, logits_rows = [], [], []
        row = 0
        for c in plan.chunks:
            n = len(c.token_ids)
            chunks.append(SequenceChunk(row, row + n, c.end, c.block_table))
            tokens.append(c.token_ids)
            if c.sample:
                logits_rows.append(row + n - 1)
            row += n
        return build_forward_batch(tokens, chunks, self.cache.block_size, logits_rows, self.model.device)

    def _lora_batch(self, plan: IterationPlan, num_tokens: int):
        slots = self.bank.activate([self.adapters[name] for name in plan.adapters])
        per_token = []
        for c in plan.chunks:
            per_token.extend([slots[c.adapter] if c.adapter is not None else -1] * len(c.token_ids))
        return self.bank.batch(torch.tensor(per_token, dtype=torch.long, device=self.model.device))

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.model.device).manual_seed(seed)
            self.generators[request_id] = gen
        return gen
