"""Model graders on the server: their calls run on the server's engine, as the caller's requests (its tenant's
share of the engine), naming any model the caller may use (the base, a shared adapter, one of its fine-tuned models
or checkpoints, loaded on first use). A grader whose ``model`` the caller may not use is refused up front."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from coserve.engine.chat_judge import chat_judge
from coserve.engine.engine_loop import EngineLoop
from coserve.engine.loop_client import LoopClient
from coserve.finetune.graders import Grader
from coserve.finetune.model_graders import Judge
from coserve.server.errors import bad_request
from coserve.server.models import ModelRegistry

# Grading runs off the event loop (a python grader's process, a model grader's requests) on threads of its own: a
# model grader may load its model on the default executor, which grading must not fill.
GRADING_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="coserve-grader")


def server_judge(models: ModelRegistry, loop: EngineLoop, tenant: str, client: LoopClient | None = None) -> Judge:
    """A judge for ``tenant``'s graders, to be called from a thread other than the event loop's; its requests go
    through ``client`` when given (whose ``abort`` then ends them: a reinforcement job's, when it is cancelled), else
    a client of their own."""
    return chat_judge(loop.engine.tokenizer, lambda name: models.resolve_blocking(tenant, name),
                      lambda ids, params, adapters: (client or LoopClient(loop)).generate(ids, params, adapters,
                                                                                         tenant))


def check_grader_models(grader: Grader, models: ModelRegistry, tenant: str, prefix: str = "") -> None:
    """A 400 naming the first model grader whose ``model`` the tenant may not use (``prefix``: where the grader
    sits in the request, before its own path)."""
    for g in grader.walk():
        if g.model is not None and not models.servable(tenant, g.model.model):
            param = f"{prefix}{g.where}.model"
            raise bad_request(f"{param}: the model '{g.model.model}' does not exist or you do not have access to it",
                              param, "model_not_found")
