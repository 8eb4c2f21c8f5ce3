"""Generation and adapters through an engine that runs in its own thread (an ``EngineLoop``): what a GRPO run
needs of an engine, whether an ``LLM``'s background loop or the server's. Also vLLM's ``n`` for a request: one
request per sequence (``sequences``), their outputs merged back into one (``merge_sequences``)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

from coserve.engine.engine_loop import EngineLoop
from coserve.engine.outputs import RequestOutput
from coserve.scheduler import SamplingParams
from coserve.scheduler.sampling_params import sequence_seed


def sequences(params: SamplingParams) -> list[SamplingParams]:
    """vLLM's ``n``: one request's settings per sequence, each drawing from ``seed + i`` where a seed is given (as
    the server's ``n`` choices do), so that a sequence's tokens do not depend on how many were asked for."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=sequence_seed(params.seed, i)) for i in range(params.n)]


def merge_sequences(outputs: list[RequestOutput], counts: list[int]) -> list[RequestOutput]:
    """One RequestOutput per prompt from its ``n`` requests' (consecutive in ``outputs``), as vLLM returns them:
    ``outputs[i]`` is sequence ``i``; an error is the first sequence's that failed."""
    if all(n == 1 for n in counts):
        return outputs
    merged, at = [], 0
    for n in counts:
        group, at = outputs[at:at + n], at + n
        first = group[0]
        merged.append(replace(first, outputs=[replace(o.outputs[0], index=i) for i, o in enumerate(group)],
                              num_preemptions=sum(o.num_preemptions for o in group),
                              error=next((o.error for o in group if o.error is not None), None)))
    return merged


class LoopClient:
    """Requests and adapter changes handed to ``loop``'s engine between its iterations; ``abort()`` ends the
    generation in flight (its outputs come back, finish reason "abort") and refuses any later one."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.engine = loop.engine
        self._lock = threading.Lock()  # the requests in flight are enqueued, or aborted, whole
        self._in_flight: list[str] = []
        self._closed = False

    def load_adapter(self, name: str, path: str | Path) -> None:
        self.loop.call(lambda: self.engine.load_adapter(name, path))

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; ValueError while requests still use it or when none is so named."""
        self.loop.call(lambda: self.engine.unload_adapter(name))

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 adapter: str | None | list[str | None] = None, tenant: str = "default") -> list[RequestOutput]:
        """Each token-id prompt generated with its ``params`` (``n`` sequences each) and ``adapter`` (one for all,
        or one each), outputs in prompt order."""
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        built = [self.engine.make_request(p, one, a, tenant=tenant)
                 for p, sp, a in zip(prompts, params, adapters) for one in sequences(sp)]
        return merge_sequences(self.run(built), [sp.n for sp in params])

    def run(self, built: list) -> list[RequestOutput]:
        """Requests built by ``engine.make_request``, handed over at once and run to their ends; their final
        outputs in order."""
        ids = [r.request_id for r, _ in built]
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine client was aborted")
            self.loop.post_and_wait(lambda: [self.engine.enqueue(r, t) for r, t in built], arrival=True)
            self._in_flight = ids
        try:
            return self.loop.wait_for(ids)
        finally:
            with self._lock:
                self._in_flight = []

    def abort(self) -> None:
        """End the generation in flight, if any, and refuse later ones (RuntimeError)."""
        with self._lock:
            self._closed = True
            ids, self._in_flight = self._in_flight, []
            if ids:  # before the next iteration (``call`` could wait out many of a busy engine)
                self.loop.post_and_wait(lambda: [self.engine.abort_request(i) for i in ids])
