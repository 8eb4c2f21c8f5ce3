"""Iteration-level (continuous) batching with chunked prefill under a token budget."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from coserve.kvcache import BlockManager
from coserve.scheduler.config import SchedulerConfig
from coserve.scheduler.dts import DynamicTemporalSharing, TemporalSharing
from coserve.scheduler.fairness import VirtualTokenCounter
from coserve.scheduler.finetune_work import BACKWARD, DONE, FORWARD, FinetuneProgress, FinetuneWork
from coserve.scheduler.latency_model import LatencyModel
from coserve.scheduler.ngram_drafts import propose_drafts
from coserve.scheduler.plan import ExecutionResult, InferenceChunk, IterationPlan, TokenLogprobs
from coserve.scheduler.prefix_blocks import cached_prefix, register_blocks
from coserve.scheduler.request import Request, RequestStatus
from coserve.scheduler.slice_policy import inference_shape, plan_slices
from coserve.scheduler.tpot_budget import TpotBudget


@dataclass(slots=True)
class TokenEvent:
    """A request's progress after one iteration (plain data for the output processor)."""

    request_id: str
    new_token_id: int | None  # the token sampled this iteration, if any
    logprobs: TokenLogprobs | None
    finished: bool
    finish_reason: str | None


# A burst's predicted time is kept this fraction below the slack it spends: in co-served runs at 1-3 req/s (2-core
# AMD EPYC, 100 ms bursts) a tenth of the bursts ran 1.29-1.36x their prediction, and an overrun is paid by every
# running request, a request near its first tokens most per output token.
BURST_RESERVE = 0.3


class Scheduler:
    """Decides each iteration's chunks; owns request state and KV blocks, never tensors.

    Running requests go first, oldest first, each taking as many of its pending tokens
    as the budget allows (one for a decode, a chunk for a prefill). When a running
    request needs a block and none is free, the most recently admitted running request
    is preempted: its blocks are freed and it is recomputed later. Waiting requests are
    admitted in arrival order, only when their whole prompt fits in free blocks.

    Finetuning jobs then take the rest of the iteration (``config.policy``, ``slice_policy``):
    the largest slice whose predicted latency (``latency``) stays within the TPOT SLO minus a
    margin, and within every running request's slack (a request whose time per output token so
    far is behind the target gets iterations short enough to catch up), or without a latency
    model what inference left of the token budget.

    Tenants share the engine through the Virtual Token Counter (FlexLLM Algorithm 4): admission
    takes the earliest waiting request of the tenant with the smallest counter, finetuning jobs are
    served in counter order, and prompt, output and finetuning tokens are charged to their tenant.

    The temporal-sharing baselines (``temporal``, ``dts``) instead give a whole iteration to one
    job's current sequence (its forward and backward) when their controller says so, and whenever
    no request is in the engine.
    """

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, latency: LatencyModel | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # seconds; first-token times and TPOT slack are on it
        self.blocks = blocks
        self.latency = latency
        self.jobs: dict[str, FinetuneProgress] = {}  # active finetuning jobs, in the order they were added
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._step = 0
        self._finished_since_plan: list[str] = []
        self.sharing = (TemporalSharing(config.temporal_interval) if config.policy == "temporal"
                        else DynamicTemporalSharing() if config.policy == "dts" else None)
        self._finetune_turn = False  # temporal sharing: the next iteration belongs to finetuning
        self._arrivals = 0  # requests added since the last inference iteration (temporal sharing's statistics)
        self._completions = 0  # requests finished since then
        self.vtc = VirtualTokenCounter(config.fairness)
        self.job_tenants: dict[str, str] = {}  # job id -> tenant
        self._tenant_work: dict[str, int] = {}  # tenant -> its unfinished requests and active jobs
        self.tpot = TpotBudget(config)  # coserve: how long an iteration may take, and the margins that set it
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache at admission
        self.num_draft_tokens = 0  # speculative decoding: n-gram drafts proposed
        self.num_accepted_drafts = 0  # of them, the ones the model agreed with
        self.prefix_cache_hits = 0  # of them, found cached (not computed again)
        self.num_long_rope_recomputes = 0  # running requests computed again as they grew past LongRoPE's original
        #   context (``SchedulerConfig.long_rope_from``)
        # scheduler_delay_factor: when each waiting request was queued (by this clock; a preempted one is not here:
        # it resumes at once), when the last iteration that admitted prompts was planned, and how long it took
        self._queued_at: dict[str, float] = {}
        self._prompt_planned_at: float | None = None
        self.last_prompt_latency_s = 0.0

    # ---- requests in and out -------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request (the engine checks lengths and adapters first)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.config.scheduler_delay_factor:
            self._queued_at[request.request_id] = self.clock()
        self._arrivals += 1
        self._tenant_arrives(request.tenant)

    def finish_request(self, request_id: str, reason: str) -> None:
        """End a request now (a stop string, an abort); frees its blocks. Unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work(self) -> bool:
        """Whether the next plan can hold anything: requests, requests ended since the last plan (an abort of the
        last ones: their final outputs come with the next plan), or jobs the policy lets run."""
        return (self.has_unfinished() or bool(self._finished_since_plan)
                or (bool(self.jobs) and self.config.policy != "inference-only"))

    # ---- finetuning jobs -----------------------------------------------------
    def add_job(self, progress: FinetuneProgress, tenant: str = "default") -> None:
        """Start scheduling a finetuning job of ``tenant`` from ``progress`` (its position now)."""
        if progress.job_id in self.jobs:
            raise ValueError(f"job_id {progress.job_id!r} is already in use")
        if progress.phase != DONE:
            self.jobs[progress.job_id] = progress
            self.job_tenants[progress.job_id] = tenant
            self._tenant_arrives(tenant)

    def remove_job(self, job_id: str) -> None:
        """Stop scheduling a job (cancelled or finished); unknown ids are ignored."""
        if self.jobs.pop(job_id, None) is not None:
            self._tenant_leaves(self.job_tenants.pop(job_id))

    # ---- fairness --------------------------------------------------------------
    def _tenant_arrives(self, tenant: str) -> None:
        self.vtc.on_arrival(tenant)  # lifts an idle tenant's counter (no credit for idleness)
        self._tenant_work[tenant] = self._tenant_work.get(tenant, 0) + 1

    def _tenant_leaves(self, tenant: str) -> None:
        self._tenant_work[tenant] -= 1
        if not self._tenant_work[tenant]:
            del self._tenant_work[tenant]
            self.vtc.set_backlogged(tenant, False)

    def _next_waiting(self) -> Request:
        """Algorithm 4, lines 17-18: the earliest waiting request of the tenant with the smallest counter (under
        the priority policy, its request of the lowest priority value, the earliest of those)."""
        by_priority = self.config.scheduling_policy == "priority"
        if len(self._tenant_work) == 1:  # one tenant (the common case): no set of tenants to build
            return min(self.waiting, key=_priority) if by_priority else self.waiting[0]
        tenants = {r.tenant for r in self.waiting}
        tenant = self.vtc.pick(tenants)
        if by_priority:
            return min((r for r in self.waiting if r.tenant == tenant), key=_priority)
        return next(r for r in self.waiting if r.tenant == tenant)

    def pop_request(self, request_id: str) -> Request | None:
        """Forget a finished request (the engine calls this once its output is delivered)."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            return self.requests.pop(request_id)
        return None

    # ---- one iteration -------------------------------------------------------
    def schedule(self) -> IterationPlan:
        """Plan the next iteration: running requests first, then admissions."""
        plan = self._schedule()
        plan.window_map = self.blocks.drain_window_changes()
        return plan

    def _schedule(self) -> IterationPlan:
        self._step += 1
        plan = IterationPlan(step=self._step, chunks=[], finished=self._finished_since_plan)
        self._finished_since_plan = []
        policy = self.config.policy
        if policy == "finetune-only" and self.jobs:  # requests wait while a job has work
            self._plan_finetune(plan, self.config.max_num_batched_tokens, use_latency=False)
            return plan
        if self.sharing is not None and self.jobs and (self._finetune_turn or not self.has_unfinished()):
            self._finetune_turn = False
            self._plan_whole_sequence(plan)
            return plan
        budget = self._plan_inference(plan)
        if self.sharing is not None and plan.chunks:
            self._finetune_turn = self.sharing.step(len(self.waiting), len(self.running), self._arrivals,
                                                    self._completions) and bool(self.jobs)
            self._arrivals = self._completions = 0
        if policy == "coserve" and self.jobs:
            self._plan_finetune(plan, budget, use_latency=True)
        return plan

    def _plan_finetune(self, plan: IterationPlan, token_budget: int, use_latency: bool) -> None:
        """Add the jobs' slices after the inference chunks; jobs in tenant-counter order (VTC), round robin on ties."""
        order = list(self.jobs.values())
        shift = plan.step % len(order)
        order = order[shift:] + order[:shift]  # equal counters: round robin
        order.sort(key=lambda p: self.vtc.counter(self.job_tenants[p.job_id]))
        budget_s = self.iteration_budget_s()
        inference = inference_shape(plan.chunks)
        if use_latency and self._bursting():
            if budget_s < self.config.finetune_burst_s:  # decode alone, banking slack for a longer slice later
                plan.shape = inference  # still measured: the inference kind's correction
                plan.predicted_s = self.latency.predict(plan.shape) if self.latency is not None else 0.0
                return
            budget_s /= 1 + BURST_RESERVE  # a long slice's overrun lands on every running request at once
        cap = self.config.first_token_slice_s
        if use_latency and cap is not None and self.latency is not None and any(
                c.sample and c.num_output_tokens == 0 for c in plan.chunks):  # someone's first token: soon
            budget_s = min(budget_s, self.latency.predict(inference) + cap)
        latency = self.latency if use_latency else None
        plan.finetune, plan.shape = plan_slices(order, inference, latency, budget_s,
                                                token_budget, self.config.min_finetune_window)
        plan.predicted_s = latency.predict(plan.shape) if latency is not None else 0.0
        for w in plan.finetune:  # a finetuning token is charged once, when its forward window is planned
            if w.kind == FORWARD:
                self.vtc.charge_finetune(self.job_tenants[w.job_id], w.num_tokens)

    def iteration_budget_s(self) -> float:
        """The longest the next iteration's model work may take (``TpotBudget.budget_s``): within every running
        request's TPOT target, or the idle iteration's length with no request in the engine."""
        return self.tpot.budget_s(self.running, self.clock(), not self.has_unfinished(), self._bursting())

    def _bursting(self) -> bool:
        """Whether finetuning waits for banked slack (``config.finetune_burst_s``): requests are decoding, every
        one has its first token, and none waits for admission."""
        return (self.config.finetune_burst_s > 0 and bool(self.running) and not self.waiting
                and all(r.first_token_time is not None for r in self.running))

    def _plan_whole_sequence(self, plan: IterationPlan) -> None:
        """Temporal sharing's finetuning iteration: what is left of one job's current sequence, forward
        then backward through every layer (jobs take turns)."""
        order = list(self.jobs.values())
        job = order[plan.step % len(order)]
        if job.phase == FORWARD:
            plan.finetune.append(FinetuneWork(job.job_id, FORWARD, job.pending_tokens))
            token_layers = job.num_layers * job.sequence_tokens
        else:
            token_layers = job.backward_token_layers_left
        plan.finetune.append(FinetuneWork(job.job_id, BACKWARD, token_layers))

    def _plan_inference(self, plan: IterationPlan) -> int:
        """Running requests first, then admissions; returns what is left of the token budget."""
        budget = self.config.max_num_batched_tokens
        scheduled = 0
        if self.config.scheduling_policy == "priority":  # the budget goes to the most urgent first (stable)
            self.running.sort(key=_priority)
        while scheduled < len(self.running) and budget > 0:
            request = self.running[scheduled]
            if self._long_rope_due(request, request.num_computed_tokens + 1):  # its next token is past the original
                self.blocks.free(request.request_id)  # context: every token again, by the long factors
                request.num_computed_tokens = request.num_registered_blocks = 0
                self._to_long_rope(request)
                self.num_long_rope_recomputes += 1
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n > 1:
                n = self._prefill_chunk(plan, request, n)
            if n > 1 and self.blocks.releases:  # every layer sliding: a prompt's chunk cut to the free blocks (the
                n = max(1, self.blocks.fit_tokens(request.request_id, request.num_computed_tokens, n))  # ones behind
                #   its window come back as it goes) rather than preempting for it
            held = self.blocks.held_for(request.num_computed_tokens, request.num_computed_tokens + n)
            if held > self.blocks.num_blocks:
                self.running.pop(scheduled)  # can never fit, even alone: stop it rather than spin
                self._finish(request, "length")
                continue
            drafts = self._drafts(request, budget) if n == 1 else []
            if not self._reserve(request, request.num_computed_tokens + n + len(drafts), plan, scheduled):
                break  # the request itself was preempted; everything after it too
            plan.chunks.append(self._chunk(request, n, drafts))
            budget -= n + len(drafts)
            scheduled += 1
        passed = self._delay_passed()  # (measures the last prompt iteration's latency either way)
        if not plan.preempted and passed:
            admitted = len(self.running)
            budget = self._admit(plan, budget)
            if len(self.running) > admitted and self.config.scheduler_delay_factor:
                self._prompt_planned_at = self.clock()
        plan.adapters = sorted({c.adapter for c in plan.chunks if c.adapter is not None})
        plan.num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        return budget

    def update(self, plan: IterationPlan, result: ExecutionResult) -> list[TokenEvent]:
        """Advance requests and jobs by the executed plan; returns one event per sampled token, first tokens
        first (the engine delivers its outputs in this order: a server turns each into an event on one event loop,
        so a first token, whose time-to-first-token someone waits on, does not queue behind the decode tokens of
        the same iteration)."""
        for progress in result.finetune:
            if progress.job_id not in self.jobs:
                continue  # cancelled while the iteration ran
            if progress.phase == DONE:
                self.remove_job(progress.job_id)
            else:
                self.jobs[progress.job_id] = progress
        if (self.latency is not None and plan.shape is not None and result.elapsed_s > 0 and not result.interrupted
                and result.forward_error is None):  # (a forward run again in parts is not the plan's time)
            self.latency.observe(plan.shape, result.elapsed_s)  # each kind of iteration corrects its own predictions
        if self.latency is not None and self.config.policy == "coserve":
            if plan.chunks:
                shape = inference_shape(plan.chunks)
                self.tpot.observe_inference(self.clock(), self.latency.predict(shape), self.latency.fixed_s(shape))
            else:
                self.tpot.observe_inference(self.clock(), 0.0)
        events, firsts = [], []
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.is_finished:
                continue  # aborted while the iteration ran
            if chunk.request_id in result.request_errors:  # its chunk failed: its new KV slots are not registered
                request.error = result.request_errors[chunk.request_id]
                self.finish_request(request.request_id, "error")  # the engine sends its final output
                continue
            if chunk.num_drafts:
                events.append(self._speculated(request, chunk, result))
                continue
            request.num_computed_tokens = chunk.end
            if self.blocks.enable_caching:
                register_blocks(self.blocks, request)
            self.blocks.pass_window(request.request_id, request.num_computed_tokens)
            if chunk.prompt_targets is not None and len(request.prompt_logprobs) == chunk.start:
                request.prompt_logprobs.extend(result.prompt_logprobs[chunk.request_id])
            if not chunk.sample:
                continue
            if chunk.pooling is not None:  # an embedding: the prompt is computed, and that is all it asked for
                firsts.append(self._pooled(request, result.embeddings[chunk.request_id]))
                continue
            token = result.sampled[chunk.request_id]
            self._append(request, token)
            (firsts if len(request.output_token_ids) == 1 else events).append(
                TokenEvent(request.request_id, token, result.logprobs.get(request.request_id), request.is_finished,
                           request.finish_reason))
        return firsts + events

    def _append(self, request: Request, token: int) -> None:
        """One new output token: timed if first, charged to the tenant, and the request finished if it stops it."""
        if not request.output_token_ids:
            request.first_token_time = self.clock()
        request.output_token_ids.append(token)
        self.vtc.charge_output(request.tenant, 1)
        reason = self._stop_reason(request, token)
        if reason is not None:
            self.running.remove(request)
            self._finish(request, reason)
            if self.config.policy == "coserve":
                self.tpot.observe_tpot(request, self.clock())

    def _pooled(self, request: Request, embedding: list[float]) -> TokenEvent:
        """An embedding request's end: its embedding kept, the request finished (its blocks freed) with no token."""
        request.embedding = embedding
        request.first_token_time = self.clock()
        self.running.remove(request)
        self._finish(request, "stop")
        return TokenEvent(request.request_id, None, None, True, "stop")

    def _speculated(self, request: Request, chunk: InferenceChunk, result: ExecutionResult) -> TokenEvent:
        """A speculative chunk's outcome: the drafts the model agreed with and the token after them, appended one by
        one as decode steps would (stopping where one would stop); the K/V of rejected drafts are left to be
        overwritten. One event, for the last token appended."""
        more = result.more_sampled.get(chunk.request_id, [])
        self.num_accepted_drafts += len(more)
        request.num_computed_tokens = chunk.start + 1 + len(more)  # the fed token and the accepted drafts
        if self.blocks.enable_caching:
            register_blocks(self.blocks, request)
        self.blocks.pass_window(request.request_id, request.num_computed_tokens)
        token = None
        for token in [result.sampled[chunk.request_id], *more]:
            self._append(request, token)
            if request.is_finished:
                break
        return TokenEvent(request.request_id, token, None, request.is_finished, request.finish_reason)

    # ---- internals -----------------------------------------------------------
    def _reserve(self, request: Request, num_tokens: int, plan: IterationPlan, position: int) -> bool:
        """Make room for ``num_tokens`` of ``request`` (at ``position`` in the running list; those before it are
        in the plan already), preempting from the tail, or under the priority policy the lowest-priority request
        from ``position`` on (the latest of those); False if it was the victim."""
        rid = request.request_id
        lo, hi = self.blocks.window_places(request.num_computed_tokens, num_tokens)  # its keys (sliding layers)
        if not self.blocks.blocks_needed(rid, num_tokens) and self.blocks.covers(rid, hi):  # most decode steps:
            return True  # room already held
        while not (self.blocks.can_allocate(rid, num_tokens) and self.blocks.can_cover(rid, lo, hi)):
            if self.config.scheduling_policy == "priority":
                at = max(range(position, len(self.running)), key=lambda i: (self.running[i].priority, i))
                victim = self.running.pop(at)
            else:
                victim = self.running.pop()
            self._preempt(victim)
            plan.preempted.append(victim.request_id)
            if victim is request:
                return False
        self.blocks.allocate(rid, num_tokens)
        self.blocks.cover(rid, lo, hi)
        return True

    def _delay_passed(self) -> bool:
        """vLLM's ``scheduler_delay_factor``: with requests running, waiting prompts are admitted once the oldest
        has waited ``factor`` times the latency of the last iteration that admitted prompts (planned to planned),
        so that prompts arriving meanwhile share its prefill; with none running, at once."""
        factor = self.config.scheduler_delay_factor
        if not factor:
            return True
        now = self.clock()
        if self._prompt_planned_at is not None:  # the iteration after a prompt iteration: it has ended
            self.last_prompt_latency_s = now - self._prompt_planned_at
            self._prompt_planned_at = None
        if not self.waiting or not self.running:
            return True
        oldest = min(self._queued_at.get(r.request_id, float("-inf")) for r in self.waiting)
        return now - oldest >= factor * self.last_prompt_latency_s

    def _admit(self, plan: IterationPlan, budget: int) -> int:
        adapters = {r.adapter for r in self.running if r.adapter is not None}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting()
            if (request.adapter is not None and request.adapter not in adapters
                    and len(adapters) >= self.config.max_loras):
                break  # first come, first served: wait until an adapter's requests finish
            if self._long_rope_due(request, request.num_tokens):  # before its prefix-cache keys are read
                self._to_long_rope(request)
            prefix = cached_prefix(self.blocks, request)
            if not self.blocks.can_admit(request.request_id, request.num_tokens, prefix):
                break  # admitted only when the whole prompt fits (every layer sliding: its window's span)
            start = len(prefix) * self.blocks.block_size
            n = self._prefill_chunk(plan, request, min(request.num_tokens - start, budget), start)
            if self.blocks.releases:  # every layer sliding: the blocks of its first chunk, cut to the free ones (its
                n = self.blocks.fit_tokens(request.request_id, start, n, prefix)  # later chunks take theirs as those
                if n == 0:  # behind the window are given up); else the whole prompt's
                    break
            held = start + n if self.blocks.releases else request.num_tokens
            window = self.blocks.window_places(start, start + n)  # its first chunk's keys (sliding layers)
            if not self.blocks.can_cover(request.request_id, *window, prefix):
                break
            self.waiting.remove(request)
            self._queued_at.pop(request.request_id, None)
            self.vtc.charge_input(request.tenant, request.num_tokens)
            self.blocks.allocate(request.request_id, held, prefix)
            self.blocks.cover(request.request_id, *window)
            if prefix:  # those blocks' K/V are in the cache already: computing starts after them
                request.num_registered_blocks = len(prefix)
                request.num_computed_tokens = len(prefix) * self.blocks.block_size
                if not request.num_preemptions:
                    request.num_cached_tokens = request.num_computed_tokens
            if self.blocks.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.adapter is not None:
                adapters.add(request.adapter)
            plan.chunks.append(self._chunk(request, n))
            budget -= n
        return budget

    def _prefill_chunk(self, plan: IterationPlan, request: Request, n: int, start: int | None = None) -> int:
        """The hybrid token scheduler's prefill chunk: with requests decoding, ``n`` prompt tokens of ``request`` cut
        to what keeps the iteration's predicted time within their TPOT budget (``iteration_budget_s``), but not
        below ``config.min_prefill_chunk`` (prompts keep moving when decodes are behind). Other policies, and
        iterations with no request decoding, take the whole token budget's chunk."""
        floor = self.config.min_prefill_chunk
        if (self.config.policy != "coserve" or self.latency is None or n <= floor
                or not any(r.first_token_time is not None for r in self.running)):
            return n
        start = request.num_computed_tokens if start is None else start  # (a request being admitted: after its
        #   cached prefix)
        fit = self.latency.max_tokens_within(inference_shape(plan.chunks), self.iteration_budget_s(),
                                             "prefill_tokens", start + min(n, 512) // 2, max_n=n)
        return max(floor, fit)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Speculative decoding: n-gram drafts for a decoding request that may take them, as many as the budget,
        its max_tokens, the context and the free KV blocks (no preemption for a guess) allow."""
        if not self.config.speculative_tokens:
            return []
        p = request.params
        limit = min(self.config.speculative_tokens, budget - 1, p.max_tokens - len(request.output_token_ids) - 1,
                    self.config.max_model_len - request.num_tokens - 1)
        if self.config.long_rope_from is not None and not request.long_rope:  # drafts within the original context
            limit = min(limit, self.config.long_rope_from - request.num_tokens)  # (their logits rotate short)
        if limit <= 0 or not p.speculable:
            return []
        drafts = propose_drafts(request.token_ids(0, request.num_tokens), limit)
        end = request.num_tokens + len(drafts)
        if drafts and not (self.blocks.can_allocate(request.request_id, end) and self.blocks.can_cover(
                request.request_id, *self.blocks.window_places(request.num_computed_tokens, end))):
            return []
        self.num_draft_tokens += len(drafts)
        return drafts

    def _chunk(self, request: Request, n: int, drafts: list[int] = ()) -> InferenceChunk:
        start = request.num_computed_tokens
        sample = start + n == request.num_tokens
        history = ((request.prompt_token_ids, list(request.output_token_ids))
                   if sample and request.params.reads_history else None)
        targets = None
        if request.params.prompt_logprobs is not None and len(request.prompt_logprobs) == start:  # not yet scored
            targets = request.prompt_token_ids[start + 1:min(start + n, request.num_prompt_tokens - 1) + 1] or None
        return InferenceChunk(
            request_id=request.request_id, start=start, token_ids=request.token_ids(start, start + n) + list(drafts),
            block_table=self.blocks.block_table(request.request_id), adapter=request.adapter,
            sample=sample, params=request.params, num_output_tokens=len(request.output_token_ids), history=history,
            prompt_targets=targets, num_drafts=len(drafts), pooling=request.pooling if sample else None,
            long_rope=request.long_rope)

    def _long_rope_due(self, request: Request, num_tokens: int) -> bool:
        """Whether computing ``request``'s first ``num_tokens`` tokens takes it past LongRoPE's original context
        while its tokens so far rotated by the short factors."""
        return (self.config.long_rope_from is not None and not request.long_rope
                and num_tokens > self.config.long_rope_from)

    def _to_long_rope(self, request: Request) -> None:
        """From now on every token of ``request`` rotates by LongRoPE's long factors (it holds no computed token):
        its blocks' prefix-cache keys change with that."""
        request.long_rope = True
        request.block_keys = []

    def _preempt(self, request: Request) -> None:
        self.blocks.free(request.request_id)
        request.num_computed_tokens = request.num_registered_blocks = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: str) -> None:
        self.blocks.free(request.request_id)
        self._queued_at.pop(request.request_id, None)  # ended while waiting
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._finished_since_plan.append(request.request_id)
        self._completions += 1
        self._tenant_leaves(request.tenant)

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if not params.ignore_eos and token in request.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.config.max_model_len:
            return "length"
        return None


def _priority(request: Request) -> int:
    return request.priority
