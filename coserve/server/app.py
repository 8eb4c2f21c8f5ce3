"""The server: one engine (in its own thread) behind every route; ``build_app`` wires the pieces."""

from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

from coserve import __version__
from coserve.engine.config import EngineConfig
from coserve.engine.engine_loop import EngineLoop
from coserve.engine.llm_engine import LLMEngine
from coserve.server.reasoning import reasoning_parser
from coserve.server import (conversations_api, embeddings_api, errors, evals_api, graders_api, inference_api,
                            lean_routes, responses_api, scores_api)
from coserve.server.auth import Authenticator
from coserve.server.batches import BATCH_PRIORITY, BatchRunner
from coserve.server.batches_api import router as batches_router
from coserve.server.uploads_api import router as uploads_router
from coserve.server.config import ServerConfig
from coserve.server.context import ServerContext
from coserve.server.eval_runs import EvalRunner
from coserve.server.fine_tuning_api import router as fine_tuning_router
from coserve.server.permissions_api import router as permissions_router
from coserve.server.stored_chat import router as stored_chat_router
from coserve.server.background_responses import RESTARTED, BackgroundResponses
from coserve.server.generation import EngineClient
from coserve.server.jobs import JobManager
from coserve.server.metrics import JOB_STATES, ServerMetrics
from coserve.server.middleware import ServerMiddleware
from coserve.server.models import ADAPTER_NAME, ModelRegistry
from coserve.server.store import Store

log = logging.getLogger("coserve.server")


def build_app(config: ServerConfig, engine_config: EngineConfig) -> FastAPI:
    """Load the model, open the state directory and return the ASGI app (the engine starts with it)."""
    engine = LLMEngine(engine_config)
    reasoner = reasoning_parser(config.reasoning_parser, engine.tokenizer) if config.reasoning_parser else None
    for name, path in config.adapters.items():
        if not ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"--adapter: the name {name!r} must be letters, digits, '.', '_' or '-'")
        try:
            engine.load_adapter(name, path)
        except ValueError as e:
            raise ValueError(f"--adapter {name}={path}: {e}") from e
    base = config.served_model_name or Path(config.model).resolve().name
    store = Store(config.state_dir)
    for stale in store.end_unfinished_responses(RESTARTED):  # background responses a stopped server left
        log.warning("background response %s: the server stopped before it finished; marked failed", stale)
    loop = EngineLoop(engine)
    models = ModelRegistry(base, loop, store, Path(config.state_dir), config.max_loaded_models)
    for name in config.adapters:
        models.add_shared(name)

    def engine_state() -> dict:
        s = engine.scheduler
        return {"requests_running": len(s.running), "requests_waiting": len(s.waiting),
                "kv_cache_usage": s.blocks.usage, "preemptions": s.num_preemptions,
                "failed_iterations": engine.num_failed_iterations, "batch_invariant": engine.batch_invariant,
                "adapters_loaded": len(engine.adapters), "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits, "spec_draft_tokens": s.num_draft_tokens,
                "spec_accepted_tokens": s.num_accepted_drafts}

    def job_counts() -> dict:
        return {status: store.count_jobs(status) for status in JOB_STATES}

    metrics = ServerMetrics(engine_state, job_counts, store.count_batches)
    jobs = JobManager(store, loop, config, metrics, models, reasoner)
    auth = Authenticator(config.api_keys)
    batches = BatchRunner(store, config.state_dir,
                          priority=BATCH_PRIORITY if engine_config.scheduling_policy == "priority" else None)
    client = EngineClient(loop, config.max_waiting_requests, config.stream_interval)
    evals = EvalRunner(store, models, config.python_graders, reasoning=reasoner)
    ctx = ServerContext(config, client, store, models, jobs, metrics, auth, batches, evals, reasoner,
                        BackgroundResponses())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        models.event_loop = asyncio.get_running_loop()  # model graders resolve their models from other threads
        switch = sys.getswitchinterval()
        sys.setswitchinterval(config.gil_switch_interval_ms / 1000)  # the event loop waits less on the engine thread
        jobs.start()
        batches.start()
        evals.start()
        try:
            yield
        finally:
            await ctx.background.stop()
            await evals.stop()
            await batches.stop()
            jobs.stop()
            loop.stop()
            store.close()
            sys.setswitchinterval(switch)

    app = FastAPI(title="coserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.coserve = ctx
    errors.install(app)
    app.include_router(inference_api.router)
    app.include_router(responses_api.router)
    app.include_router(conversations_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(scores_api.router)
    app.include_router(fine_tuning_router)
    app.include_router(permissions_router)
    app.include_router(stored_chat_router)
    app.include_router(graders_api.router)
    app.include_router(evals_api.router)
    app.include_router(batches_router)
    app.include_router(uploads_router)
    lean_routes.install(app, [inference_api.router, responses_api.router, embeddings_api.router],
                        [inference_api.chat_completions, inference_api.completions, responses_api.responses,
                         embeddings_api.embeddings])

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD too: what some load balancers' checks send
    async def health():
        if loop.error is not None:
            return Response(status_code=503, content=f"engine stopped: {loop.error!r}")
        return Response(status_code=200)

    @app.get("/version")  # vLLM's: which server build answers (no key, as /health)
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus(request: Request):
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(ServerMiddleware, auth=auth, metrics=metrics, max_body=config.max_body_bytes,
                       max_upload=config.max_upload_bytes, engine_error=lambda: loop.error)
    batches.app = evals.app = app  # batch requests and eval samples go through the same middleware and routes
    return app
