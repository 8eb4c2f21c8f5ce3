"""Model graders on the server: their calls run on the server's engine, as the caller's requests (its tenant's
share of the engine), naming any model the caller may use (the base, a shared adapter, one of its fine-tuned models
or checkpoints, loaded on first use). A grader whose ``model`` the caller may not use is refused up front
(``request_grader``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from coserve.engine.chat_judge import chat_judge
from coserve.engine.engine_loop import EngineLoop
from coserve.engine.loop_client import LoopClient
from coserve.finetune.graders import Grader, parse_grader
from coserve.finetune.model_graders import Judge
from coserve.scheduler.sampling_params import Reasoning
from coserve.server.errors import bad_request
from coserve.server.models import ModelRegistry

# Grading runs off the event loop (a python grader's process, a model grader's requests) on threads of its own: a
# model grader may load its model on the default executor, which grading must not fill.
GRADING_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="coserve-grader")


def server_judge(models: ModelRegistry, loop: EngineLoop, tenant: str, client: LoopClient | None = None,
                 reasoning: Reasoning | None = None) -> Judge:
    """A judge for ``tenant``'s graders, to be called from a thread other than the event loop's; its requests go
    through ``client`` when given (whose ``abort`` then ends them: a reinforcement job's, when it is cancelled), else
    a client of their own. ``reasoning``: the server's reasoning parser (the grader model reasons before its reply)."""
    return chat_judge(loop.engine.tokenizer, lambda name: models.resolve_blocking(tenant, name),
                      lambda ids, params, adapters: (client or LoopClient(loop)).generate(ids, params, adapters,
                                                                                         tenant), reasoning)


def request_grader(spec: object, where: str, allow_python: bool, servable=None) -> Grader:
    """A grader from a request, checked: a 400 naming its field (``grader.operation``), or its ``model`` when
    ``servable(model)`` says the caller may not use it."""
    try:
        grader = parse_grader(spec, where, allow_python=allow_python)
    except ValueError as e:
        message = str(e)
        raise bad_request(message, message.split(":", 1)[0], "invalid_grader") from None
    for g in grader.walk() if servable is not None else ():
        if g.model is not None and not servable(g.model.model):
            raise bad_request(f"{g.where}.model: the model '{g.model.model}' does not exist or you do not have "
                              "access to it", f"{g.where}.model", "model_not_found")
    return grader
