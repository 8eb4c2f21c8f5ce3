"""Eval runs (OpenAI's Evals API), run inside the server: each item of a run is sampled, for a ``completions`` run,
by the server's own chat route as the run's tenant (in-process, as batches are, beside the interactive traffic and
the fine-tuning jobs), then graded by every testing criterion of its eval (a model grader's calls on the engine
too), and stored as an output item before it counts; a server restarted after a crash goes on with the items not
yet stored. A run being cancelled takes no new item; those in flight end and are kept.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from coserve.finetune.graders import GradingError
from coserve.scheduler.sampling_params import Reasoning
from coserve.server.batches import COUNTS_EVERY_S, RETRY_SECONDS, RETRY_STATUSES, call_route
from coserve.server.eval_data import (Criterion, RunSource, check_run_source, grader_sample, item_messages,
                                     item_schema, parse_criterion, response_sample)
from coserve.server.grader_judge import GRADING_THREADS, server_judge
from coserve.server.models import ModelRegistry
from coserve.server.store import Store

log = logging.getLogger("coserve.server")
ACTIVE = ("queued", "in_progress")
FINISHED = ("completed", "failed", "canceled")
NO_ERROR = {"code": "", "message": ""}  # OpenAI's run object always has an error object


class EvalRunner:
    """Runs the server's eval runs; ``start`` and everything after it on the server's event loop."""

    def __init__(self, store: Store, models: ModelRegistry, allow_python: bool, concurrency: int = 4,
                 reasoning: Reasoning | None = None) -> None:
        self.store, self.models, self.allow_python = store, models, allow_python
        self.reasoning = reasoning  # the server's reasoning parser: model graders read the reply after the reasoning
        self.concurrency = concurrency  # items of one run in flight at once
        self.app = None  # the ASGI app whose chat route samples (set once it is built)
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: set[str] = set()

    def start(self) -> None:
        """Go on with every run a previous server left unfinished."""
        for tenant, run in self.store.eval_runs_with_status(*ACTIVE):
            self.submit(tenant, run)

    def submit(self, tenant: str, run: dict, source: RunSource | None = None) -> None:
        """Run ``run`` (``source``: its data source as the request checked it; else read again, on a restart)."""
        task = asyncio.get_running_loop().create_task(self._run(tenant, run, source))
        self._tasks[run["id"]] = task
        task.add_done_callback(lambda _: self._tasks.pop(run["id"], None))

    def cancel(self, run_id: str) -> dict:
        """The run takes no new item; it ends ``canceled`` with what is done."""
        self._cancelled.add(run_id)
        return self.store.update_eval_run(run_id, status="canceled")

    async def remove(self, run_id: str) -> None:
        """Stop the run at once (before it is deleted): its task is cancelled, requests in flight included."""
        self._cancelled.add(run_id)
        task = self._tasks.get(run_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    async def _run(self, tenant: str, run: dict, source: RunSource | None) -> None:
        run_id = run["id"]
        try:
            ev = self.store.get_eval(tenant, run["eval_id"])
            if ev is None:
                return  # deleted meanwhile, with its runs
            criteria = [parse_criterion(c, f"testing_criteria.{i}", self.allow_python)
                        for i, c in enumerate(ev["testing_criteria"])]
            if source is None:
                source = await asyncio.to_thread(check_run_source, run["data_source"], self.store, tenant,
                                                 lambda m: self.models.servable(tenant, m), item_schema(ev),
                                                 run["created_at"])  # its items as they were when it was made
        except Exception as e:  # its file deleted, the server restarted without --python-graders, ...
            message = getattr(e, "message", None) or str(e)
            self.store.update_eval_run(run_id, status="failed", error={"code": "invalid_run", "message": message})
            return
        if run_id in self._cancelled:
            return
        await asyncio.to_thread(self.store.update_eval_run, run_id, status="in_progress")
        tally = Tally(source, criteria)
        for x in await asyncio.to_thread(self.store.eval_items_done, run_id):  # a resumed run's: counted already
            tally.add(x)
        judge = server_judge(self.models, self.models.loop, tenant, reasoning=self.reasoning)
        slots = asyncio.Semaphore(self.concurrency)
        written = [time.monotonic()]  # when the counts were last written (every COUNTS_EVERY_S while it runs)

        async def one(index: int, entry: dict) -> None:
            async with slots:
                if run_id in self._cancelled:
                    return
                obj = await self._item(tenant, run, source, criteria, judge, index, entry)
                await asyncio.to_thread(self.store.add_eval_item, run_id, obj)
                tally.add(obj)
                if time.monotonic() - written[0] >= COUNTS_EVERY_S:
                    written[0] = time.monotonic()
                    await asyncio.to_thread(self.store.update_eval_run, run_id, **tally.fields())

        try:
            await asyncio.gather(*(one(i, e) for i, e in enumerate(source.entries) if i not in tally.done))
        except Exception as e:  # a fault of ours: the run fails rather than hanging
            log.exception("eval run %s failed", run_id)
            self.store.update_eval_run(run_id, status="failed",
                                       error={"code": "internal_error", "message": f"{type(e).__name__}: {e}"})
            return
        finished = {} if run_id in self._cancelled else {"status": "completed"}
        await asyncio.to_thread(self.store.update_eval_run, run_id, **tally.fields(), **finished)
        self._cancelled.discard(run_id)

    async def _item(self, tenant: str, run: dict, source: RunSource, criteria: list[Criterion], judge, index: int,
                    entry: dict) -> dict:
        """One item sampled (a completions run) and graded: its output item."""
        item = entry["item"]
        sample = entry["sample"] if source.model is None else await self._sample(tenant, source, item)
        results, status = [], "pass"
        if sample.get("error"):
            status = "error"
        else:
            namespace = grader_sample(sample)
            loop = asyncio.get_running_loop()
            for c in criteria:
                outcome = (await loop.run_in_executor(GRADING_THREADS, c.grader.outcomes, [namespace], [item],
                                                      judge))[0][0]
                result = {"name": c.grader.name, "type": c.grader.type, "sample": None}
                if isinstance(outcome, GradingError):
                    result |= {"score": 0.0, "passed": False, "error": {"code": outcome.kind, "message": str(outcome)}}
                    status = "error"
                else:
                    result |= {"score": outcome, "passed": c.passed(outcome)}
                    if not result["passed"] and status == "pass":
                        status = "fail"
                results.append(result)
        return {"id": f"outputitem_{secrets.token_hex(12)}", "object": "eval.run.output_item",
                "created_at": int(time.time()), "eval_id": run["eval_id"], "run_id": run["id"], "status": status,
                "datasource_item_id": index, "datasource_item": item, "results": results, "sample": sample}

    async def _sample(self, tenant: str, source: RunSource, item: dict) -> dict:
        """The item's completion from the chat route, as the sample OpenAI's output items show."""
        s = source.sampling
        sample = {"input": [], "output": [], "finish_reason": "", "model": source.model, "seed": s.get("seed", 0),
                  "temperature": s["temperature"], "top_p": s["top_p"],
                  "max_completion_tokens": s["max_completion_tokens"],
                  "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0},
                  "error": None}
        try:
            sample["input"] = item_messages(source, item)
        except ValueError as e:
            return sample | {"error": {"code": "invalid_variable_error", "message": str(e)}}
        url, body = ("/v1/responses", responses_body(source.model, sample["input"], s)) if source.route == "responses" \
            else ("/v1/chat/completions", {"model": source.model, "messages": sample["input"], **s})
        while True:
            status, reply = await call_route(self.app, tenant, url, body)
            if status not in RETRY_STATUSES:
                break
            await asyncio.sleep(RETRY_SECONDS)
        if status != 200:
            error = reply.get("error") or {}
            return sample | {"error": {"code": error.get("code") or str(status), "message": error.get("message", "")}}
        return sample | (response_sample(reply) if source.route == "responses" else chat_sample(reply))


def chat_sample(reply: dict) -> dict:
    """A chat completion's reply as the sample OpenAI's output items show."""
    choice, usage = reply["choices"][0], reply.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    return {"output": [{"role": "assistant", "content": choice["message"].get("content") or ""}],
            "finish_reason": choice.get("finish_reason") or "", "model": reply.get("model"),
            "usage": {"prompt_tokens": usage.get("prompt_tokens", 0),
                      "completion_tokens": usage.get("completion_tokens", 0),
                      "total_tokens": usage.get("total_tokens", 0), "cached_tokens": cached}}


def responses_body(model: str, messages: list[dict], sampling: dict) -> dict:
    """The Responses API request a responses run sends for a conversation with its ``sampling_params``."""
    body: dict = {"model": model, "input": messages, "temperature": sampling["temperature"],
                  "top_p": sampling["top_p"], "max_output_tokens": sampling["max_completion_tokens"]}
    if "seed" in sampling:
        body["seed"] = sampling["seed"]
    fmt = sampling.get("response_format")
    if fmt is not None:  # the chat form's json_schema one level up, as the Responses API's text.format has it
        body["text"] = {"format": {"type": fmt["type"], **(fmt.get("json_schema") or {})}}
    return body


class Tally:
    """A run's counts as its items are stored: results, each criterion's, and the sampling model's usage."""

    def __init__(self, source: RunSource, criteria: list[Criterion]) -> None:
        self.source = source
        self.done: set[int] = set()  # datasource_item_ids stored
        self.counts = {"total": len(source.entries), "passed": 0, "failed": 0, "errored": 0}
        self.criteria = {c.grader.name: [0, 0] for c in criteria}  # passed, failed
        self.usage = {"invocation_count": 0, "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                      "cached_tokens": 0}

    def add(self, item: dict) -> None:
        if item["datasource_item_id"] in self.done:
            return
        self.done.add(item["datasource_item_id"])
        self.counts[{"pass": "passed", "fail": "failed"}.get(item["status"], "errored")] += 1
        for r in item["results"]:
            self.criteria[r["name"]][0 if r["passed"] else 1] += 1
        sample = item["sample"]
        if self.source.model is not None and not sample.get("error"):
            self.usage["invocation_count"] += 1
            for k in ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens"):
                self.usage[k] += sample["usage"][k]

    def fields(self) -> dict:
        """The run object's count fields."""
        usage = [{"model_name": self.source.model, **self.usage}] if self.source.model is not None else []
        return {"result_counts": dict(self.counts), "per_model_usage": usage,
                "per_testing_criteria_results": [{"testing_criteria": name, "passed": p, "failed": f}
                                                 for name, (p, f) in self.criteria.items()]}


def new_run(eval_id: str, name: str | None, source: RunSource, data_source: dict, metadata: dict | None) -> dict:
    """A run object, queued."""
    return {"id": f"evalrun_{secrets.token_hex(12)}", "object": "eval.run", "eval_id": eval_id,
            "name": name or f"run on {source.model or 'given samples'}", "model": source.model or "",
            "status": "queued", "created_at": int(time.time()), "data_source": data_source, "error": NO_ERROR,
            "metadata": metadata, "per_model_usage": [], "per_testing_criteria_results": [], "report_url": "",
            "result_counts": {"total": len(source.entries), "passed": 0, "failed": 0, "errored": 0}}
