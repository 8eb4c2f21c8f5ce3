"""The torch side of an iteration: IterationPlan in, ExecutionResult out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from coserve.engine.forward_pieces import ForwardPieces
from coserve.engine.mixed_forward import mixed_forward
from coserve.finetune.job import FinetuneJob
from coserve.guided.guide import GuidedDecoding
from coserve.model.attention import PagedKVCache
from coserve.model.decode_graphs import DecodeGraphs
from coserve.model.decoder import BATCH_INVARIANT_ROWS, DecoderModel
from coserve.model.forward_batch import SequenceChunk, build_forward_batch
from coserve.model.logit_adjust import LogitAdjustments, bad_word_bans
from coserve.model.sampling import SamplingRow, sample, top_logprobs
from coserve.peft import AdapterSlots, ServedAdapter
from coserve.scheduler.finetune_work import BACKWARD, DONE, FORWARD, FinetuneProgress
from coserve.scheduler.plan import ExecutionResult, InferenceChunk, IterationPlan, TokenLogprobs
from coserve.scheduler.pooling_params import PoolingParams

log = logging.getLogger("coserve.engine")


def job_progress(job_id: str, job: FinetuneJob) -> FinetuneProgress:
    """A job's position as plain data for the scheduler."""
    phase, pending, forward_done, layers_left, seq_tokens = job.position()
    return FinetuneProgress(job_id, phase, pending, forward_done, layers_left, seq_tokens,
                            job.model.cfg.num_layers, job.tokens_done)


class ModelExecutor:
    """Runs plans on one device: builds the flat batch, runs the model (with a finetuning forward window
    in the same call), samples, then runs the plan's finetuning backward windows."""

    def __init__(self, model: DecoderModel, cache: PagedKVCache, slots: AdapterSlots,
                 adapters: dict[str, ServedAdapter], seed: int, fuse_finetuning: bool = True,
                 graphs: DecodeGraphs | None = None, guided: GuidedDecoding | None = None,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids  # what min_tokens bans until enough tokens are out
        self.guided = guided  # token masks of requests whose output must match a JSON schema
        self.graphs = graphs  # recorded decode forwards (CUDA), or None
        self.fuse_finetuning = fuse_finetuning  # a forward window shares the inference rows' matmul calls
        self.jobs: dict[str, FinetuneJob] = {}  # the engine's active finetuning jobs, by id (shared)
        self.cache = cache
        self.slots = slots  # device slots of the LoRA and IA3 adapters
        self.adapters = adapters  # the engine's resident adapters, by name (shared, read only here)
        self.generators: dict[str, torch.Generator] = {}  # per-request RNGs of seeded requests
        self.default_generator = torch.Generator(device=model.device).manual_seed(seed)
        # says whether a new request waits to enter the engine: backward slices stop between two windows then
        # (and a forward window without inference between two pieces), so that a request arriving during a
        # long finetuning iteration waits one window, not the iteration
        self.arrivals: Callable[[], bool] | None = None
        self.pieces = ForwardPieces()  # the timings of forward pieces, and the size they call for

    def execute(self, plan: IterationPlan) -> ExecutionResult:
        """Run one iteration's chunks in one forward call and sample where the plan asks."""
        self.cache.map_window(plan.window_map)  # the sliding layers' storages lent while planning
        for request_id in plan.finished:
            self.generators.pop(request_id, None)
            if self.guided is not None:
                self.guided.release(request_id)
        if plan.is_empty:
            return ExecutionResult()
        start_time = time.perf_counter()
        result = ExecutionResult()
        forward = next((w for w in plan.finetune if w.kind == FORWARD), None)
        if plan.chunks:
            self._inference(plan, result, forward)
        elif forward is not None:
            self._forward_alone(forward, result)
        for w in plan.finetune:
            if w.kind == BACKWARD and w.job_id not in result.finetune_errors:  # each at least one window
                try:
                    cut = self.jobs[w.job_id].backward_token_layers(w.num_tokens, self.arrivals)
                    result.interrupted = result.interrupted or cut
                except Exception as e:  # a job that cannot go on stops alone; inference keeps serving
                    result.finetune_errors[w.job_id] = f"{type(e).__name__}: {e}"
        result.finetune = [job_progress(w.job_id, self.jobs[w.job_id]) for w in plan.finetune]
        for p in result.finetune:
            if p.job_id in result.finetune_errors:
                p.phase = DONE
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        result.elapsed_s = time.perf_counter() - start_time
        return result

    def _forward_alone(self, w, result: ExecutionResult) -> None:
        """A forward window with no inference beside it. Where arrivals are watched, it runs in pieces
        (``forward_pieces.py``) and stops between two once a request waits (a piece is a window of its own: the
        job's state is the same as after a shorter planned window)."""
        job = self.jobs[w.job_id]
        try:
            piece = None if self.arrivals is None else self.pieces.tokens()
            left, loss = w.num_tokens, 0.0
            while left > 0 and job.next_work() == "forward":
                if left < w.num_tokens and self.arrivals():
                    result.interrupted = True
                    break
                n = min(left, piece or left, job.pending_tokens())
                start = time.perf_counter()
                loss += job.forward(n)  # a float: the device has finished the piece
                self.pieces.record(n, time.perf_counter() - start)
                left -= n
            result.finetune_losses[w.job_id] = loss
        except Exception as e:  # a job that cannot go on stops alone; inference keeps serving
            result.finetune_errors[w.job_id] = f"{type(e).__name__}: {e}"

    def _inference(self, plan: IterationPlan, result: ExecutionResult, forward) -> None:
        """The inference chunks' forward (with the finetuning window in the same call), then sampling."""
        t = sum(len(c.token_ids) for c in plan.chunks)
        # Inference rows share the finetuning window's matmuls when the call has enough rows to be
        # batch-invariant; alone they run padded to that many (and to whole GEMM tiles where tiles are on:
        # coserve/model/tiled_gemm.py), so their results are the same either way.
        rows = self.model.padded_rows(t)
        fused = forward is not None and self.fuse_finetuning and t + forward.num_tokens >= BATCH_INVARIANT_ROWS
        sampling = [c for c in plan.chunks if c.sample]
        try:
            hidden = self._rows_forward(plan, result, forward if fused else None, rows)
        except Exception as e:  # whose fault? each part runs again alone, and only what raises alone fails
            fused = fused and forward.job_id in result.finetune_losses  # the window had run: the fault came after
            hidden, sampling = self._forward_apart(plan, result, e)
        if forward is not None and not fused:
            self._forward_alone(forward, result)
        if any(c.pooling is not None for c in sampling):
            hidden, sampling = self._pool(hidden, sampling, result)
        if sampling:
            try:
                self._tokens(hidden, sampling, result, min_rows=1)
            except Exception as e:  # the LM head's call (a device out of memory): each chunk's rows alone
                self._tokens_apart(hidden, sampling, result, e)

    @staticmethod
    def _pool(hidden: torch.Tensor, sampling: list[InferenceChunk], result: ExecutionResult
              ) -> tuple[torch.Tensor, list[InferenceChunk]]:
        """Embedding requests' results from their chunks' last rows (``pooled``); returns the other chunks' rows and
        chunks, to be sampled as usual (an embedding chunk has one row: it never carries drafts)."""
        keep_rows, rest, pooling, row = [], [], [], 0
        for c in sampling:
            if c.pooling is not None:
                pooling.append((row, c))
            else:
                keep_rows.extend(range(row, row + 1 + c.num_drafts))
                rest.append(c)
            row += 1 + c.num_drafts
        index = torch.tensor([r for r, _ in pooling], dtype=torch.long, device=hidden.device)
        rows = hidden[index].float().cpu()  # one copy from the device for every embedding of the iteration
        for v, (_, c) in zip(rows, pooling):
            result.embeddings[c.request_id] = pooled(v, c.pooling)
        return hidden[torch.tensor(keep_rows, dtype=torch.long, device=hidden.device)], rest

    def _tokens(self, hidden: torch.Tensor, sampling: list[InferenceChunk], result: ExecutionResult,
                min_rows: int) -> None:
        """The sampling chunks' new tokens from their hidden rows: speculative chunks' drafts verified, the rest
        sampled (``min_rows``: the LM head's calls are padded to at least that many rows)."""
        if any(c.num_drafts for c in sampling):  # speculative chunks score every row: verify them apart
            hidden, sampling = self._verify_drafts(hidden, sampling, result, min_rows)
        if not sampling:
            return
        logits = self._logits(hidden, min_rows)  # [N, V] float32
        try:
            self._sample(logits, sampling, result)
        except Exception:  # some request's own settings: each row alone, and only the rows that raise fail
            for i, c in enumerate(sampling):  # (a seeded row that drew before the raise draws anew)
                try:
                    self._sample(logits[i:i + 1], [c], result)
                except Exception as e:
                    self._fail_request(c, result, e)

    def _tokens_apart(self, hidden: torch.Tensor, sampling: list[InferenceChunk], result: ExecutionResult,
                      error: Exception) -> None:
        """After the LM head's batched call raised ``error``: each chunk's rows through it alone, so that only the
        requests whose own rows raise fail. A chunk's rows are padded to the two rows past which the engine's
        GEMMs round a row alike in any call (``batch_invariance.py``), so its tokens and logprobs are the batch's."""
        result.forward_error = f"{type(error).__name__}: {error}"
        log.error("iteration's LM head failed (%s); each request's rows run again alone", result.forward_error,
                  exc_info=error)
        if self.model.device.type == "cuda" and isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        row = 0
        for c in sampling:
            n = 1 + c.num_drafts
            try:
                self._tokens(hidden[row:row + n], [c], result, min_rows=min(2, hidden.shape[0]))
            except Exception as e:
                self._fail_request(c, result, e)
            row += n

    def _logits(self, hidden: torch.Tensor, min_rows: int) -> torch.Tensor:
        """The LM head's logits for ``hidden``, in a call of at least ``min_rows`` rows (the first row repeated)."""
        n = hidden.shape[0]
        if n >= min_rows:
            return self.model.logits(hidden)
        return self.model.logits(torch.cat([hidden, hidden[:1].expand(min_rows - n, -1)]))[:n]

    @staticmethod
    def _fail_request(chunk: InferenceChunk, result: ExecutionResult, error: Exception) -> None:
        """``chunk``'s request ends with ``error``; whatever the iteration had produced for it is dropped."""
        result.request_errors[chunk.request_id] = f"{type(error).__name__}: {error}"
        for produced in (result.sampled, result.more_sampled, result.logprobs, result.prompt_logprobs,
                         result.embeddings):
            produced.pop(chunk.request_id, None)

    def _sample(self, logits: torch.Tensor, sampling: list[InferenceChunk], result: ExecutionResult) -> None:
        """The chunks' tokens (and logprobs where asked) from their rows of ``logits``, into ``result``."""
        if all(c.params.greedy and not c.params.reads_history for c in sampling):
            tokens = logits.argmax(dim=-1).tolist()  # what ``sample`` gives such rows, without building them
        else:
            rows = [SamplingRow(c.params.temperature, c.params.top_k, c.params.top_p,
                                self._generator(c.request_id, c.params.seed),
                                _adjustments(c, self.eos_token_ids), self._allowed(c), c.params.min_p)
                    for c in sampling]
            tokens = sample(logits, rows, self.default_generator)
        vocab = logits.shape[-1]
        if not all(0 <= t < vocab for t in tokens):  # NaN probabilities draw past the end: the next forward fails
            raise ValueError(f"a sampled token id is outside the vocabulary [0, {vocab}) (non-finite logits)")
        wants = [i for i, c in enumerate(sampling) if c.params.logprobs is not None]
        scored = top_logprobs(logits[wants], [tokens[i] for i in wants],
                              [sampling[i].params.logprobs for i in wants]) if wants else []
        result.sampled.update({c.request_id: t for c, t in zip(sampling, tokens)})
        for i, (chosen, rank, top) in zip(wants, scored):
            result.logprobs[sampling[i].request_id] = TokenLogprobs(tokens[i], chosen, top, rank)

    def _verify_drafts(self, hidden: torch.Tensor, sampling: list[InferenceChunk], result: ExecutionResult,
                       min_rows: int = 1) -> tuple[torch.Tensor, list[InferenceChunk]]:
        """Greedy verification of speculative chunks (their rows come first-to-last in ``hidden``): the model's
        token at every row; the drafts it agrees with, in order, and its token after the last of them, are the
        request's new tokens. Returns the other chunks' rows and chunks, to be sampled as usual."""
        keep_rows, rest, spans, row = [], [], [], 0
        for c in sampling:
            n = 1 + c.num_drafts
            if c.num_drafts:
                spans.append((c, row, n))
            else:
                keep_rows.append(row)
                rest.append(c)
            row += n
        rows = [r for _, start, n in spans for r in range(start, start + n)]
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        chosen_all = self._logits(hidden[index], min_rows).argmax(dim=-1).tolist()  # one LM-head call for every draft
        at = 0
        for c, _, n in spans:
            chosen = chosen_all[at:at + n]
            at += n
            accepted = 0
            while accepted < c.num_drafts and chosen[accepted] == c.token_ids[1 + accepted]:
                accepted += 1
            result.sampled[c.request_id] = chosen[0]
            result.more_sampled[c.request_id] = chosen[1:accepted + 1]
        return hidden[torch.tensor(keep_rows, dtype=torch.long, device=hidden.device)], rest

    def _rows_forward(self, plan: IterationPlan, result: ExecutionResult, fused_window, rows: int) -> torch.Tensor:
        """The hidden states of the plan's rows that sample (with ``fused_window`` in the same call, if any)."""
        hidden = None if fused_window is not None else self._graphed(plan, rows)  # decode only: a graph's replay
        if hidden is None:
            return self._eager_forward(plan, result, fused_window, rows)
        if all(c.sample for c in plan.chunks):
            return hidden
        return hidden[torch.tensor([i for i, c in enumerate(plan.chunks) if c.sample], device=hidden.device)]

    def _forward_apart(self, plan: IterationPlan, result: ExecutionResult, error: Exception
                       ) -> tuple[torch.Tensor | None, list[InferenceChunk]]:
        """After the iteration's forward raised ``error``: each chunk's forward alone, so that only the requests
        whose own rows raise fail (``result.request_errors``; the rest of the iteration stands). A row comes out
        the same in any batch (batch-invariant matmuls, per-sequence attention), and a chunk run again rewrites
        the same KV slots. Returns the sampling chunks' hidden rows and those chunks, in plan order."""
        result.forward_error = f"{type(error).__name__}: {error}"
        log.error("iteration %d: its forward failed (%s); each part runs again alone", plan.step,
                  result.forward_error, exc_info=error)
        if self.model.device.type == "cuda" and isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        parts, sampling = [], []
        for c in plan.chunks:
            alone = IterationPlan(plan.step, [c], adapters=[c.adapter] if c.adapter is not None else [])
            try:
                hidden = self._rows_forward(alone, result, None, self.model.padded_rows(len(c.token_ids)))
            except Exception as e:
                self._fail_request(c, result, e)
                continue
            if c.sample:  # a copy: a graph's replay returns a view of its output, which the next replay overwrites
                parts.append(hidden.clone())
                sampling.append(c)
        return (torch.cat(parts) if parts else None), sampling

    def _eager_forward(self, plan: IterationPlan, result: ExecutionResult, fused_window, rows: int) -> torch.Tensor:
        """The plan's forward, kernel by kernel (with ``fused_window``, a finetuning forward window, in its matmul
        calls); returns the hidden states of the rows that sample, having scored prompts where asked."""
        batch = self._forward_batch(plan)
        adapters = self._adapter_batch(plan, rows) if plan.adapters else None
        if fused_window is not None:
            job = self.jobs[fused_window.job_id]
            hidden, loss = mixed_forward(self.model, batch, self.cache, adapters,
                                         job.forward_slice(fused_window.num_tokens), adapter_rows=rows)
            job.forward_ran(loss)
            result.finetune_losses[fused_window.job_id] = loss
        else:
            hidden = self.model.forward(batch, self.cache, adapters, min_rows=rows)
        self._score_prompts(plan, batch, hidden, result)
        return hidden[batch.logits_rows]

    def _graphed(self, plan: IterationPlan, rows: int) -> torch.Tensor | None:
        """The hidden states of a decode-only plan without adapters or prompt scoring, by a CUDA graph; None where
        the plan is not one or no graph fits it."""
        if (self.graphs is None or plan.adapters or not self.graphs.covers_lengths(plan.chunks)
                or any(c.prompt_targets is not None for c in plan.chunks)):
            return None
        chunks = [SequenceChunk(i, i + 1, c.end, c.block_table, c.long_rope) for i, c in enumerate(plan.chunks)]
        return self.graphs.forward([c.token_ids[0] for c in plan.chunks], chunks, rows)

    def _score_prompts(self, plan: IterationPlan, batch, hidden: torch.Tensor, result: ExecutionResult) -> None:
        """Log-probabilities of the prompt tokens that chunks predict, for requests that asked (prompt_logprobs)."""
        for chunk, seq in zip(plan.chunks, batch.chunks):
            if chunk.prompt_targets is None:
                continue
            n = len(chunk.prompt_targets)
            logits = self.model.logits(hidden[seq.start:seq.start + n])
            scored = top_logprobs(logits, chunk.prompt_targets, [chunk.params.prompt_logprobs] * n)
            result.prompt_logprobs[chunk.request_id] = [TokenLogprobs(t, lp, top, rank) for t, (lp, rank, top)
                                                        in zip(chunk.prompt_targets, scored)]

    def _forward_batch(self, plan: IterationPlan):
        chunks, tokens, logits_rows = [], [], []
        row = 0
        for c in plan.chunks:
            n = len(c.token_ids)
            chunks.append(SequenceChunk(row, row + n, c.end, c.block_table, c.long_rope))
            tokens.append(c.token_ids)
            if c.sample:  # a speculative chunk's every row: the fed token's and each draft's next token
                logits_rows.extend(range(row + n - 1 - c.num_drafts, row + n))
            row += n
        return build_forward_batch(tokens, chunks, self.cache.block_size, logits_rows, self.model.device,
                                   varlen=not self.model.cfg.per_chunk_attention,
                                   long_rope_from=self.model.long_rope_from)

    def _adapter_batch(self, plan: IterationPlan, num_rows: int):
        """The adapters (LoRA, IA3 or both) of the plan's rows; rows past its tokens (padding) use the base model."""
        runs = [(c.adapter, len(c.token_ids)) for c in plan.chunks]
        runs.append((None, num_rows - sum(n for _, n in runs)))
        return self.slots.batch([self.adapters[name] for name in plan.adapters], runs)

    def _allowed(self, chunk: InferenceChunk) -> torch.Tensor | None:
        """The tokens a guided request may sample next (its outputs so far match its schema's or pattern's prefix);
        with a reasoning parser's tags, the guide constrains the reply after the reasoning only."""
        p = chunk.params
        if not p.guided:
            return None
        if self.guided is None:
            raise RuntimeError("guided decoding: this executor has no vocabulary to guide decoding with")
        out = chunk.history[1]
        begin = 0 if p.reasoning is None else p.reasoning.reply_start(out)
        if begin is None:  # reasoning: unconstrained until it ends
            return None
        mask = self.guided.mask(chunk.request_id, p.guided_json, out[begin:] if begin else out, p.guided_choice,
                                p.guided_regex, p.guided_grammar)
        if p.reasoning is not None and not out and not p.reasoning.opened:  # the first token may open reasoning
            mask = mask.clone()
            mask[p.reasoning.start] = True
        return mask

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.model.device).manual_seed(seed)
            self.generators[request_id] = gen
        return gen


def pooled(row: torch.Tensor, params: PoolingParams) -> list[float]:
    """A final hidden state as an embedding: float32, cut to ``params.dimensions``, divided by its L2 norm where
    ``params.normalize`` (as ``F.normalize``: a zero vector stays zero)."""
    v = row.float()
    if params.dimensions is not None:
        v = v[:params.dimensions]
    if params.normalize:
        v = torch.nn.functional.normalize(v, dim=0)
    return v.tolist()


def _adjustments(chunk: InferenceChunk, eos_ids: frozenset[int]) -> LogitAdjustments | None:
    """The chunk's request's penalties, biases and masks, if it has any. Until ``min_tokens`` are out, its stop tokens
    (and end-of-sequence, unless ignored or a guide decides when the text may end) are banned."""
    if chunk.history is None or not chunk.params.adjusts_logits:
        return None
    p = chunk.params
    prompt_ids, output_ids = chunk.history
    banned = bad_word_bans(p.bad_words_token_ids, output_ids) if p.bad_words_token_ids else []
    if len(output_ids) < p.min_tokens:
        banned += list(p.stop_token_ids) + ([] if p.ignore_eos or p.guided else sorted(eos_ids))
    return LogitAdjustments(output_ids, prompt_ids, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                            p.logit_bias, banned, p.allowed_token_ids)
