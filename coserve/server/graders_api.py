"""OpenAI's grader endpoints: ``POST /v1/fine_tuning/alpha/graders/validate`` (is this grader one the server can
run?) and ``POST /v1/fine_tuning/alpha/graders/run`` (one model sample's reward against a data-set item), for the
graders of ``coserve/finetune/graders.py`` (model graders graded by the server's engine: ``grader_judge.py``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field

from coserve.finetune.graders import GradingError, Grader, make_sample
from coserve.finetune.model_graders import CountingJudge
from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.grader_judge import GRADING_THREADS, request_grader, server_judge
from coserve.server.json_text import TextJSONRoute
from coserve.server.protocol import Body

router = APIRouter(route_class=TextJSONRoute)
ERROR_FLAGS = ("formula_parse_error", "invalid_variable_error", "model_grader_parse_error",
               "model_grader_refusal_error", "model_grader_server_error", "other_error",
               "python_grader_runtime_error", "python_grader_server_error", "sample_parse_error",
               "truncated_observation_error", "unresponsive_reward_error")


class GraderValidateRequest(Body):
    grader: dict[str, Any]


class GraderRunRequest(Body):
    grader: dict[str, Any]
    model_sample: str = Field(max_length=1_000_000)
    item: Any = None


def checked_grader(spec: dict, ctx: ServerContext, tenant: str) -> Grader:
    """The request's grader, or a 400 naming its field (``grader.operation``; ``grader.model`` for a model the caller
    may not use)."""
    return request_grader(spec, "grader", ctx.config.python_graders, lambda model: ctx.models.servable(tenant, model))


@router.post("/v1/fine_tuning/alpha/graders/validate")
async def validate_grader(body: GraderValidateRequest, request: Request, ctx: ServerContext = Depends(context)):
    checked_grader(body.grader, ctx, tenant_of(request))
    return {"grader": body.grader}


@router.post("/v1/fine_tuning/alpha/graders/run")
async def run_grader(body: GraderRunRequest, request: Request, ctx: ServerContext = Depends(context)):
    """The sample's reward (0 when it cannot be graded, with the reason in ``metadata.errors``); a multi grader's
    graders' scores in ``metadata.scores`` and ``sub_rewards``; a model grader's calls run on the engine as the
    caller's requests."""
    tenant = tenant_of(request)
    grader = checked_grader(body.grader, ctx, tenant)
    judge = CountingJudge(server_judge(ctx.models, ctx.client.loop, tenant, reasoning=ctx.reasoning))
    errors: dict[str, Any] = {flag: False for flag in ERROR_FLAGS}
    errors["python_grader_runtime_error_details"] = errors["python_grader_server_error_type"] = None
    errors["model_grader_server_error_details"] = None
    started = time.perf_counter()
    try:
        scores, subs = await asyncio.get_running_loop().run_in_executor(
            GRADING_THREADS, grader.grade, [make_sample(body.model_sample)], [body.item], judge)
        reward, sub_rewards = scores[0], {k: v[0] for k, v in subs.items()}
    except GradingError as e:
        reward, sub_rewards = 0.0, {}
        errors[e.kind] = True
        errors["details"] = str(e)  # coserve's: what went wrong, whatever the flag
        if e.kind == "python_grader_runtime_error":
            errors["python_grader_runtime_error_details"] = str(e)
        elif e.kind == "python_grader_server_error":
            errors["python_grader_server_error_type"] = str(e)
        elif e.kind == "model_grader_server_error":
            errors["model_grader_server_error_details"] = str(e)
    used = judge.per_model
    metadata = {"name": grader.name, "type": grader.type, "errors": errors,
                "execution_time": time.perf_counter() - started, "scores": sub_rewards or {grader.name: reward},
                "token_usage": sum(n["total_tokens"] for n in used.values()) if used else None,
                "sampled_model_name": next(iter(used)) if len(used) == 1 else None}
    return {"reward": reward, "metadata": metadata, "sub_rewards": sub_rewards,
            "model_grader_token_usage_per_model": used}
