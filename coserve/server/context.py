"""What every route shares: the engine client, the store, the model registry, the job manager, metrics,
the batch runner, the eval runner, the reasoning parser, the background responses in flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from coserve.server.auth import Authenticator
from coserve.server.config import ServerConfig
from coserve.server.generation import EngineClient
from coserve.server.metrics import ServerMetrics
from coserve.server.models import ModelRegistry
from coserve.server.store import Store

if TYPE_CHECKING:
    from coserve.server.background_responses import BackgroundResponses
    from coserve.server.batches import BatchRunner
    from coserve.server.eval_runs import EvalRunner
    from coserve.server.jobs import JobManager
    from coserve.server.reasoning import ReasoningParser


@dataclass(slots=True)
class ServerContext:
    config: ServerConfig
    client: EngineClient
    store: Store
    models: ModelRegistry
    jobs: "JobManager"
    metrics: ServerMetrics
    auth: Authenticator
    batches: "BatchRunner | None" = None
    evals: "EvalRunner | None" = None
    reasoning: "ReasoningParser | None" = None  # --reasoning-parser, for this model's tokenizer
    background: "BackgroundResponses | None" = None  # the background responses generating now

    @property
    def engine(self):
        return self.client.engine


async def context(request: Request) -> ServerContext:
    """The shared objects (a coroutine: FastAPI would run a plain function in a worker thread, a thread hop on
    every request)."""
    return request.app.state.coserve


def tenant_of(request: Request) -> str:
    """The caller's tenant (401 without a valid key when keys are configured); set by the auth middleware."""
    return request.state.tenant
