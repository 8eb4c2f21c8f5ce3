"""The judge that runs model graders' calls (``coserve/finetune/model_graders.py``) on an engine: each call's
conversation rendered by the model's chat template, its model resolved to the base (None) or an adapter, and all
the calls generated together, batched with whatever else the engine serves. ``llm_judge`` is an ``LLM``'s (its base
model by the directory's name, and its loaded adapters); the server makes its own (``coserve/server/grader_judge.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from coserve.finetune.model_graders import Judge, ModelCall, ModelReply
from coserve.model.chat_prompt import render_conversation
from coserve.scheduler.sampling_params import Reasoning

if TYPE_CHECKING:
    from coserve.engine.llm import LLM


def chat_judge(tokenizer, resolve: Callable[[str], str | None], generate, reasoning: Reasoning | None = None) -> Judge:
    """``resolve(model)``: the adapter serving a call's model (None: the base), or LookupError; ``generate(token
    ids, sampling params, adapters)``: the engine's outputs, in order. With a reasoning parser (a server's
    ``--reasoning-parser``) the grader model may reason first: its structured output's guide starts after the
    reasoning, and the grader reads the reply after it."""

    def judge(calls: list[ModelCall]) -> list[ModelReply]:
        adapters = [resolve(c.model) for c in calls]
        ids = [list(tokenizer(render_conversation(tokenizer, c.messages), add_special_tokens=False)["input_ids"])
               for c in calls]
        tags = [reasoning.tokens(x) if reasoning is not None else None for x in ids]
        outs = generate(ids, [replace(c.params, reasoning=t) if t is not None else c.params
                              for c, t in zip(calls, tags)], adapters)
        replies = []
        for out, t in zip(outs, tags):
            if out.error is not None:
                raise RuntimeError(f"the grader model's request failed ({out.error})")
            seq = out.outputs[0]
            text = seq.text if t is None else (reasoning.split(t, seq.text)[1] or "")
            replies.append(ModelReply(text, seq.finish_reason, len(out.prompt_token_ids), len(seq.token_ids)))
        return replies

    return judge


def llm_judge(llm: LLM) -> Judge:
    """Model graders graded by ``llm``'s engine: ``model`` names the base model (its directory's name, or the path it
    was loaded from) or an adapter loaded with ``llm.load_adapter``."""
    base = {llm.model_dir.name, str(llm.model_dir), str(llm.model_dir.resolve())}

    def resolve(name: str) -> str | None:
        if name in base:
            return None
        if name in llm.engine.adapters:
            return name
        raise LookupError(f"model {name!r}: neither the base model ({llm.model_dir.name}) nor a loaded adapter")

    return chat_judge(llm.tokenizer, resolve, lambda ids, params, adapters: llm.generate(ids, params, adapters))
