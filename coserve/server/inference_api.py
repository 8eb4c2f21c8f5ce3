"""OpenAI-compatible inference: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streamed as
server-sent events or not), and vLLM's runtime LoRA loading."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request

from coserve.engine.outputs import RequestOutput
from coserve.model.chat_prompt import ChatPromptError, render_conversation
from coserve.model.tokenizer import encode
from coserve.peft import AdapterError
from coserve.scheduler import Request as EngineRequest
from coserve.scheduler import SamplingParams
from coserve.scheduler.sampling_params import ReasoningTokens, sequence_seed, truncated_prompt
from coserve.scheduler.plan import TokenLogprobs
from coserve.server.beam_api import completions_by_beam_search
from coserve.server.choices import (Choice, Job, best_choices, events, finish_reason, gather_all, new_job,
                                    stream_usage, streaming, usage)
from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.errors import APIError, bad_request, not_found
from coserve.server.generation import TextDelta, on_engine_async
from coserve.server.json_text import TextJSONRoute
from coserve.server.models import ADAPTER_NAME, load_adapter
from coserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoraRequest,
                                     Sampling, TokenizeRequest, UnloadLoraRequest)
from coserve.server.response_format import guided_output
from coserve.server.stored_chat import store_after, store_chat
from coserve.server.tools import ToolPlan, template_messages, template_tools, tool_plan

router = APIRouter(route_class=TextJSONRoute)
MAX_STOPS = 4  # OpenAI's limit on stop sequences
INLINE_TOKENIZE_CHARS = 16_384  # prompts up to this many characters (or token ids) are tokenized on the event loop
# OpenAI fields this server does not implement -> the values that ask for nothing (anything else is a 400)
UNSUPPORTED = {"suffix": (None, ""), "functions": (None, []), "function_call": (None, "none", "auto")}


@router.get("/v1/models")
async def list_models(request: Request, ctx: ServerContext = Depends(context)):
    return {"object": "list", "data": ctx.models.listing(tenant_of(request))}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request, ctx: ServerContext = Depends(context)):
    entry = ctx.models.describe(tenant_of(request), model)
    if entry is None:
        raise not_found("model", model, "model")
    return entry


@router.delete("/v1/models/{model:path}")
async def delete_model(model: str, request: Request, ctx: ServerContext = Depends(context)):
    return await ctx.models.delete(tenant_of(request), model)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, ctx: ServerContext = Depends(context)):
    """vLLM's: the token ids a prompt (or chat messages, as the chat API renders them) becomes."""
    await ctx.models.resolve(tenant_of(request), body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt: give either prompt or messages", "prompt")
    if body.messages is not None:
        ids = await off_loop_if_long(messages_chars(body.messages), render_chat, ctx, body)
    else:
        ids = await off_loop_if_long(len(body.prompt), encode, ctx.engine.tokenizer, body.prompt,
                                     body.add_special_tokens)
    return {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, ctx: ServerContext = Depends(context)):
    """vLLM's: the text of token ids."""
    await ctx.models.resolve(tenant_of(request), body.model)
    vocab = ctx.engine.model_config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})", "tokens")
    return {"prompt": ctx.engine.tokenizer.decode(body.tokens)}


# ---- generation --------------------------------------------------------------------------------------------
def reject_unsupported(body: Sampling) -> None:
    """400 for a field that asks for what this server does not do (silently ignoring it would be worse)."""
    for name, accepted in UNSUPPORTED.items():
        value = getattr(body, name, None)
        if not any(value == a and type(value) is type(a) for a in accepted):
            raise bad_request(f"{name}: is not supported by this server", name, "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")


def candidates_per_prompt(body: CompletionRequest) -> int:
    """OpenAI's ``best_of`` (``n`` when absent): the completions generated per prompt, of which the ``n`` best return;
    400 naming it where it asks for less than ``n``, or for more with a stream or beam search."""
    if body.best_of is None or body.best_of == body.n:
        return body.n
    if body.best_of < body.n:
        raise bad_request(f"best_of: must be at least n ({body.n}), got {body.best_of}", "best_of")
    if body.stream:
        raise bad_request("best_of: results cannot be streamed when best_of is more than n", "best_of")
    if body.use_beam_search:
        raise bad_request("best_of: not available with use_beam_search (n sets the beams)", "best_of")
    return body.best_of


def check_token_ids(body: Sampling, vocab_size: int) -> None:
    """400 naming the field when one of vLLM's token-id lists holds an id outside the vocabulary."""
    for name in ("stop_token_ids", "allowed_token_ids"):
        bad = next((t for t in getattr(body, name) or () if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"{name}: {bad} is not a token id of this model (0 to {vocab_size - 1})", name)


def logit_bias(body: Sampling, vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as strings) as token ids; 400 naming the field when a key or value is bad."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise bad_request(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                              "logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias: the bias of token {key} must lie in [-100, 100], got {value}",
                              "logit_bias")
        bias[int(key)] = value
    return bias


def sampling_params(body: Sampling, max_tokens: int, logprobs: int | None, index: int,
                    bias: dict[int, float] | None = None, prompt_logprobs: int | None = None,
                    guided: dict[str, Any] | None = None, reasoning: ReasoningTokens | None = None,
                    keep_special: bool = False) -> SamplingParams:
    """``body``'s sampling fields as ``SamplingParams``; ``guided``: the guided_* fields (``guided_output``);
    ``reasoning``: a reasoning parser's tags, after which the guide begins; ``keep_special``: the text shows special
    tokens whatever ``skip_special_tokens`` says (a tool-call parser reads them: ``ToolPlan.keeps_special``)."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop: at most {MAX_STOPS} sequences, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad_request("stop: sequences must be non-empty", "stop")
    if body.bad_words is not None and any(not w.strip() for w in body.bad_words):
        raise bad_request("bad_words: words must be non-blank strings", "bad_words")
    seed = sequence_seed(body.seed, index)
    temperature = 1.0 if body.temperature is None else body.temperature  # SamplingParams floors tiny ones
    if body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens: {body.min_tokens} is more than the {max_tokens} tokens it may generate",
                          "min_tokens")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          top_k=body.top_k, top_p=1.0 if body.top_p is None else body.top_p, seed=seed, stop=stops,
                          ignore_eos=body.ignore_eos, logprobs=logprobs, presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                          logit_bias=bias or {}, prompt_logprobs=prompt_logprobs, **(guided or {}),
                          min_p=body.min_p, min_tokens=body.min_tokens, stop_token_ids=list(body.stop_token_ids or []),
                          include_stop_str_in_output=body.include_stop_str_in_output,
                          allowed_token_ids=body.allowed_token_ids,
                          skip_special_tokens=body.skip_special_tokens and not keep_special,
                          bad_words=list(body.bad_words or []), reasoning=reasoning)


def max_tokens_for(ctx: ServerContext, prompt_len: int, asked: int | None, param: str, prompt_param: str) -> int:
    limit = ctx.engine.max_model_len
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len}",
                       prompt_param, "context_length_exceeded")
    if asked is None:
        return limit - prompt_len
    if prompt_len + asked > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} in the completion)",
                       param, "context_length_exceeded")
    return asked


def truncate(ctx: ServerContext, body: Sampling, ids: list[int]) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (``truncated_prompt``), before any check of its
    length against the context."""
    if body.truncate_prompt_tokens == 0:
        raise bad_request("truncate_prompt_tokens: must be -1 (the model's context) or a positive number of tokens",
                          "truncate_prompt_tokens")
    try:
        return truncated_prompt(ids, body.truncate_prompt_tokens, ctx.engine.max_model_len)
    except ValueError as e:
        raise bad_request(str(e), "truncate_prompt_tokens") from e


def make_request(ctx: ServerContext, tenant: str, ids: list[int], params: SamplingParams, adapter: str | None,
                 prompt_param: str, priority: int = 0) -> EngineRequest:
    """A validated engine request (400 naming the field when it is not)."""
    rid = f"{tenant}-{secrets.token_hex(8)}"
    if priority and ctx.engine.config.scheduling_policy != "priority":
        raise bad_request(f"priority: {priority} needs a server started with --scheduling-policy priority",
                          "priority")
    try:
        request, _ = ctx.engine.make_request(ids, params, adapter, request_id=rid, tenant=tenant, priority=priority)
    except ValueError as e:
        raise APIError(400, str(e), prompt_param, "invalid_prompt") from e
    return request


def submit(ctx: ServerContext, job: Job, requests: list[tuple[EngineRequest, str]], streamed: bool) -> None:
    """Hand every choice's request to the engine at once (all were validated first)."""
    ctx.client.check_capacity(len(requests))
    for index, (request, prefix) in enumerate(requests):
        job.choices.append(Choice(index, request.prompt_token_ids, ctx.client.submit(request, streamed=streamed),
                                  TextDelta.for_stops(request.params.stop), prefix))
    ctx.metrics.requests_started(len(requests))


def start_choice(ctx: ServerContext, tenant: str, ids: list[int], params: SamplingParams, adapter: str | None,
                 index: int, prompt_param: str) -> Choice:
    """One request, validated and submitted (the in-process load benchmark's path)."""
    request = make_request(ctx, tenant, ids, params, adapter, prompt_param)
    return Choice(index, ids, ctx.client.submit(request), TextDelta.for_stops(params.stop))


# ---- logprobs ---------------------------------------------------------------------------------------------
def token_text(ctx: ServerContext, token_id: int) -> str:
    return ctx.engine.tokenizer.decode([token_id])


def token_name(ctx: ServerContext, token_id: int, as_ids: bool) -> str:
    """How logprobs name a token: its text, or with vLLM's ``return_tokens_as_token_ids`` ``"token_id:N"`` (which
    tells apart tokens of the same text, and names those whose bytes are no whole character)."""
    return f"token_id:{token_id}" if as_ids else token_text(ctx, token_id)


def chat_logprobs(ctx: ServerContext, items: list[TokenLogprobs], as_ids: bool = False) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        name = token_name(ctx, token_id, as_ids)
        return {"token": name, "logprob": logprob, "bytes": list(name.encode())}
    return [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top.items()]}
            for t in items]


def completion_logprobs(ctx: ServerContext, items: list[TokenLogprobs], offset: int, as_ids: bool = False) -> dict:
    """The completions API's logprobs; ``text_offset`` counts the tokens' texts whatever names them."""
    tokens, offsets = [], []
    for t in items:
        offsets.append(offset)
        tokens.append(token_name(ctx, t.token_id, as_ids))
        offset += len(token_text(ctx, t.token_id))
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{token_name(ctx, i, as_ids): lp for i, lp in t.top.items()} for t in items],
            "text_offset": offsets}


def prompt_and_completion_logprobs(ctx: ServerContext, prompt_ids: list[int],
                                   prompt_logprobs: list[TokenLogprobs | None], completion: dict, num_top: int,
                                   as_ids: bool = False) -> dict:
    """The completions API's logprobs of an echoed prompt (its top ``num_top``) followed by those of its
    completion."""
    texts = [token_text(ctx, t) for t in prompt_ids]
    offsets = [0, *itertools.accumulate(len(t) for t in texts[:-1])]
    return {"tokens": [token_name(ctx, t, as_ids) for t in prompt_ids] + completion["tokens"],
            "token_logprobs": [None if lp is None else lp.logprob for lp in prompt_logprobs]
            + completion["token_logprobs"],
            "top_logprobs": [None if lp is None else {token_name(ctx, i, as_ids): v for i, v in
                                                      itertools.islice(lp.top.items(), num_top)}
                             for lp in prompt_logprobs] + completion["top_logprobs"],
            "text_offset": offsets + completion["text_offset"]}


def vllm_prompt_logprobs(ctx: ServerContext, prompt_logprobs: list[TokenLogprobs | None], num_top: int
                         ) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first token (nothing predicts it), then for each token
    ``{token id: {"logprob", "rank", "decoded_token"}}``, the token itself first, then the top ``num_top``."""
    def entry(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(ctx, token_id)}
    out: list[dict | None] = []
    for lp in prompt_logprobs:
        if lp is None:
            out.append(None)
            continue
        scored = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
        for rank, (i, v) in enumerate(itertools.islice(lp.top.items(), num_top), start=1):
            scored.setdefault(str(i), entry(i, v, rank))
        out.append(scored)
    return out


def prompt_scoring(body: Sampling, echoed: int | None = None) -> int | None:
    """The top-N the engine scores each prompt token with: vLLM's ``prompt_logprobs`` and an echoed prompt's
    ``logprobs`` (``echoed``), the larger; None for neither. vLLM's is refused with ``stream``, as vLLM does."""
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs: not available with stream", "prompt_logprobs")
    asked = [n for n in (body.prompt_logprobs, echoed) if n is not None]
    return max(asked) if asked else None


def new_logprobs(choice: Choice, out: RequestOutput) -> list[TokenLogprobs]:
    items = out.outputs[0].logprobs or []
    fresh = items[choice.logprobs_sent:]
    choice.logprobs_sent = len(items)
    return fresh


# ---- /v1/completions ---------------------------------------------------------------------------------------
async def off_loop_if_long(chars: int, fn, *args):
    """``fn(*args)`` (tokenizing) in a worker thread for long texts (megabytes take seconds and would stall every
    stream), inline for short ones (the thread hop costs more than they do, on every request's TTFT)."""
    if chars > INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def messages_chars(messages) -> int:
    """Characters of chat messages' contents (plain or in text parts) and past tool calls' arguments."""
    return sum((len(m.content) if isinstance(m.content, str) else sum(len(part.text) for part in m.content or []))
               + sum(len(c.custom.input if c.type == "custom" else c.function.arguments) for c in m.tool_calls or [])
               for m in messages)


def prompt_chars(prompt) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, (str, list)))


def completion_prompts(ctx: ServerContext, prompt, param: str = "prompt", with_text: bool = True
                       ) -> list[tuple[list[int], str]]:
    """Each prompt as (token ids, text): a string, strings, token ids, or lists of token ids (errors name
    ``param``; token ids are decoded for their text unless ``with_text`` is False, where the text is "")."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request(f"{param}: is empty", param)
    if isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            ids = encode(ctx.engine.tokenizer, p)
            text = p
        else:
            ids = list(p)
            vocab = ctx.engine.model_config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise bad_request(f"{param}[{i}]: token ids must be in [0, {vocab})", param)
            text = ctx.engine.tokenizer.decode(ids) if with_text else ""
        if not ids:
            raise bad_request(f"{param}[{i}]: is empty", param)
        out.append((ids, text))
    return out


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    reject_unsupported(body)
    adapter = await ctx.models.resolve(tenant, body.model)
    scored = body.logprobs if body.echo else None  # echo with logprobs: the prompt's tokens are scored too
    prompt_top = prompt_scoring(body, scored)
    check_token_ids(body, ctx.engine.model_config.vocab_size)
    bias = logit_bias(body, ctx.engine.model_config.vocab_size)
    guided = guided_output(body)
    best_of = candidates_per_prompt(body)
    single = isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int))
    ctx.client.check_capacity((1 if single else len(body.prompt)) * best_of)  # before tokenizing them all
    prompts = await off_loop_if_long(prompt_chars(body.prompt), completion_prompts, ctx, body.prompt)
    if body.truncate_prompt_tokens is not None:  # the echoed text is the kept tokens'
        prompts = [(kept, text if len(kept) == len(ids) else ctx.engine.tokenizer.decode(kept))
                   for ids, text in prompts for kept in [truncate(ctx, body, ids)]]
    if body.use_beam_search:
        if guided:
            field = "structured_outputs" if body.structured_outputs is not None else next(iter(guided))
            raise bad_request(f"{field}: not available with use_beam_search", field)
        limit = min(max_tokens_for(ctx, len(ids), body.max_tokens, "max_tokens", "prompt") for ids, _ in prompts)
        return await completions_by_beam_search(ctx, tenant, body, adapter, prompts, limit, make_request)
    job = new_job(request, f"cmpl-{secrets.token_hex(12)}", body.model, best_of)
    ranked = best_of > body.n  # candidates are ranked by their tokens' logprobs: each sampled token's is kept
    logprobs = 0 if ranked and body.logprobs is None else body.logprobs
    requests = []
    for ids, text in prompts:
        max_tokens = max_tokens_for(ctx, len(ids), body.max_tokens, "max_tokens", "prompt")
        for j in range(best_of):
            params = sampling_params(body, max_tokens, logprobs, j, bias, prompt_logprobs=prompt_top, guided=guided)
            requests.append((make_request(ctx, tenant, ids, params, adapter, "prompt", body.priority),
                             text if body.echo else ""))
    submit(ctx, job, requests, body.stream)

    def offset_base(c: Choice) -> int:
        """The completion's first text offset: after the echoed prompt, counted as its tokens' texts (as the
        prompt's own offsets are; a special token's text, e.g. BOS, counts though the echoed text lacks it)."""
        if c.text_offset_base is None:
            c.text_offset_base = (sum(len(token_text(ctx, t)) for t in c.prompt_ids) if scored is not None
                                  else len(c.prefix))
        return c.text_offset_base

    def choice_json(c: Choice, out: RequestOutput, text: str, logprobs: list[TokenLogprobs], offset: int,
                    finished: bool) -> dict:
        return {"index": c.index, "text": text,
                "logprobs": (completion_logprobs(ctx, logprobs, offset, body.return_tokens_as_token_ids)
                             if body.logprobs is not None else None),
                "finish_reason": finish_reason(out) if finished else None,
                "stop_reason": out.outputs[0].stop_reason if finished else None}

    if body.stream:
        def chunk(c: Choice, out: RequestOutput | None):
            if out is None:  # the echoed prompt comes first; with logprobs, once they exist (with the first token)
                if not c.prefix or scored is not None:
                    return None
                c.prefix_sent = True
                return {"id": job.ident, "object": "text_completion", "created": job.created, "model": job.model,
                        "choices": [{"index": c.index, "text": c.prefix, "logprobs": None, "finish_reason": None}]}
            prefix = "" if c.prefix_sent else c.prefix
            c.prefix_sent = True
            offset = c.delta.sent + offset_base(c)
            text = c.delta.next(out.outputs[0].text, out.finished)
            logprobs = new_logprobs(c, out)
            if not text and not logprobs and not prefix:
                return None
            choice = choice_json(c, out, prefix + text, logprobs, offset, False)
            if prefix and scored is not None:
                choice["logprobs"] = prompt_and_completion_logprobs(ctx, c.prompt_ids, out.prompt_logprobs,
                                                                    choice["logprobs"], scored,
                                                                    body.return_tokens_as_token_ids)
            return {"id": job.ident, "object": "text_completion", "created": job.created, "model": job.model,
                    "choices": [choice]}

        def last(c: Choice, out: RequestOutput) -> dict:
            return {"id": job.ident, "object": "text_completion", "created": job.created, "model": job.model,
                    "choices": [{"index": c.index, "text": "", "logprobs": None, "finish_reason": finish_reason(out),
                                 "stop_reason": out.outputs[0].stop_reason}]}
        return streaming(events(job, ctx, chunk, last, *stream_usage(body.stream_options)), job, ctx)

    await gather_all(job, ctx, request)
    choices = []
    for index, c in enumerate(best_choices(job.choices, best_of, body.n) if ranked else job.choices):
        out = c.out
        choice = choice_json(c, out, c.prefix + out.outputs[0].text, out.outputs[0].logprobs or [], offset_base(c),
                             True)
        if scored is not None:  # the prompt's tokens first, the first of them unscored
            choice["logprobs"] = prompt_and_completion_logprobs(ctx, c.prompt_ids, out.prompt_logprobs,
                                                                choice["logprobs"], scored,
                                                                body.return_tokens_as_token_ids)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(ctx, out.prompt_logprobs, body.prompt_logprobs)
        choice["index"] = index
        choices.append(choice)
    return {"id": job.ident, "object": "text_completion", "created": job.created, "model": job.model,
            "choices": choices, "usage": usage(job)}


# ---- /v1/chat/completions ----------------------------------------------------------------------------------
def render_chat(ctx: ServerContext, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    tokenizer = ctx.engine.tokenizer
    messages = template_messages(body.messages, tokenizer.chat_template or "")
    try:
        text = render_conversation(tokenizer, messages, tools=template_tools(getattr(body, "tools", None)),
                                   add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message,
                                   chat_template_kwargs=body.template_kwargs())
    except ChatPromptError as e:
        raise bad_request(str(e), e.param) from e
    return encode(tokenizer, text, add_special_tokens=False)


def reply_text(ctx: ServerContext, job: Job, text: str) -> tuple[str | None, str]:
    """``(reasoning, reply)`` of a chat choice's whole text: the reasoning None without one (or without a
    ``--reasoning-parser``), the reply "" where there is none."""
    if job.reasoning is None:
        return None, text
    thought, reply = ctx.reasoning.split(job.reasoning, text)
    return thought, reply or ""


def echo_of(body: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's text where it is the assistant's (as with
    ``continue_final_message``), which the reply then begins with; else nothing."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant":
        return ""
    return "".join(p.text for p in last.content) if isinstance(last.content, list) else last.content or ""


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    reject_unsupported(body)
    adapter = await ctx.models.resolve(tenant, body.model)
    ids = truncate(ctx, body, await off_loop_if_long(messages_chars(body.messages), render_chat, ctx, body))
    echoed = echo_of(body)
    asked, param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None
                    else (body.max_tokens, "max_tokens"))
    max_tokens = max_tokens_for(ctx, len(ids), asked, param, "messages")
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
    check_token_ids(body, ctx.engine.model_config.vocab_size)
    bias = logit_bias(body, ctx.engine.model_config.vocab_size)
    tools = tool_plan(body, ctx.config.tool_call_parser)
    guided = tools.guide() if tools is not None and not tools.auto else guided_output(body)
    ctx.client.check_capacity(body.n)
    prompt_top = prompt_scoring(body)
    job = new_job(request, f"chatcmpl-{secrets.token_hex(12)}", body.model, body.n)
    job.reasoning = ctx.reasoning.tokens(ids) if ctx.reasoning is not None else None
    keep_special = tools is not None and tools.keeps_special
    params = [sampling_params(body, max_tokens, num_top, j, bias, prompt_logprobs=prompt_top, guided=guided,
                              reasoning=job.reasoning, keep_special=keep_special) for j in range(body.n)]
    submit(ctx, job, [(make_request(ctx, tenant, ids, p, adapter, "messages", body.priority), "") for p in params],
           body.stream)

    if body.stream:
        def head(c: Choice) -> dict:
            return {"id": job.ident, "object": "chat.completion.chunk", "created": job.created, "model": job.model}

        def chunk(c: Choice, out: RequestOutput | None):
            if out is None:
                delta = {"role": "assistant", "content": echoed}
                if tools is not None and tools.function is not None:  # the call first; its arguments as they come
                    delta = {"role": "assistant", "content": echoed or None, "tool_calls": [tools.head()]}
                return {**head(c), "choices": [{"index": c.index, "delta": delta, "logprobs": None,
                                                "finish_reason": None}]}
            text = c.delta.next(out.outputs[0].text, out.finished)  # stop strings held back too
            thought = ""
            if splits[c.index] is not None:  # the reasoning, then the reply
                thought, text = splits[c.index].feed(text, out.finished)
            if calls[c.index] is not None:  # text until a call may begin, then the calls as they are written
                safe[c.index] += text
                text, made = calls[c.index].update(safe[c.index])
                delta = {**({"content": text} if text else {}), **({"tool_calls": made} if made else {})}
            else:
                delta = ({"content": text} if tools is None else {"tool_calls": [tools.piece(text)]}) if text else {}
            if thought and body.include_reasoning:  # under both names vLLM has used (``reasoning``, its newer one)
                delta = {"reasoning_content": thought, "reasoning": thought, **delta}
            logprobs = new_logprobs(c, out)
            if not delta and not logprobs:
                return None
            return {**head(c), "choices": [{
                "index": c.index, "delta": delta or {"content": ""},
                "logprobs": ({"content": chat_logprobs(ctx, logprobs, body.return_tokens_as_token_ids)}
                             if body.logprobs else None),
                "finish_reason": None}]}

        def last(c: Choice, out: RequestOutput) -> dict:
            delta, reason, text = {}, finish_reason(out), reply_text(ctx, job, out.outputs[0].text)[1]
            content, made = tools.reply(text) if tools is not None and reason == "stop" else (text, [])
            if made:
                reason = "tool_calls"
            if calls[c.index] is not None:
                rest, deltas = calls[c.index].finish(text, content, made)
                delta = {**({"content": rest} if rest else {}), **({"tool_calls": deltas} if deltas else {})}
            return {**head(c), "choices": [{"index": c.index, "delta": delta, "logprobs": None,
                                            "finish_reason": reason}]}
        # a list of calls (required, or read from free text): each choice's stream of them
        calls = [tools.stream() if tools is not None and tools.listed else None for _ in range(body.n)]
        safe = [""] * body.n  # each choice's text that no stop string can still cut
        splits = [ctx.reasoning.splitter(job.reasoning) if job.reasoning is not None else None for _ in range(body.n)]
        sent = events(job, ctx, chunk, last, *stream_usage(body.stream_options))
        if body.store:  # kept once the stream has ended whole
            sent = store_after(sent, ctx, tenant, body, lambda: whole_chat(ctx, body, job, tools, echoed))
        return streaming(sent, job, ctx)

    await gather_all(job, ctx, request)
    reply = whole_chat(ctx, body, job, tools, echoed)
    if body.store:
        await asyncio.to_thread(store_chat, ctx, tenant, body, reply)
    return reply


def whole_chat(ctx: ServerContext, body: ChatCompletionRequest, job: Job, tools: ToolPlan | None, echoed: str
               ) -> dict:
    """The ``chat.completion`` object of a request whose choices have all ended (streamed or not)."""
    choices = []
    for c in job.choices:
        (thought, text), reason = reply_text(ctx, job, c.out.outputs[0].text), finish_reason(c.out)
        message = {"role": "assistant", "content": echoed + text if echoed or text or thought is None else None}
        content, made = tools.reply(text) if tools is not None and reason == "stop" else (text, [])
        if made:
            message = {"role": "assistant", "content": echoed + (content or "") if echoed else content,
                       "tool_calls": made}
            reason = "tool_calls"
        if thought is not None and body.include_reasoning:  # under both of vLLM's names (``reasoning``: its newer)
            message["reasoning_content"] = message["reasoning"] = thought
        choices.append({"index": c.index, "message": message,
                        "logprobs": ({"content": chat_logprobs(ctx, c.out.outputs[0].logprobs or [],
                                                               body.return_tokens_as_token_ids)}
                                     if body.logprobs else None),
                        "finish_reason": reason, "stop_reason": c.out.outputs[0].stop_reason})
    reply = {"id": job.ident, "object": "chat.completion", "created": job.created, "model": job.model,
             "choices": choices, "usage": usage(job)}
    if body.prompt_logprobs is not None:  # vLLM's: once, for the prompt every choice shares
        reply["prompt_logprobs"] = vllm_prompt_logprobs(ctx, job.choices[0].out.prompt_logprobs, body.prompt_logprobs)
    return reply


# ---- vLLM's runtime LoRA loading ---------------------------------------------------------------------------
@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, ctx: ServerContext = Depends(context)):
    if not ctx.config.allow_lora_loading:
        raise APIError(403, "Runtime LoRA loading is off; start the server with --allow-lora-loading",
                       code="lora_loading_disabled")
    name = body.lora_name
    if not ADAPTER_NAME.fullmatch(name) or name == ctx.models.base:
        raise bad_request(f"lora_name: {name!r} must be letters, digits, '.', '_' or '-' (not the base model's name)",
                          "lora_name")
    if name in ctx.models.shared:
        raise bad_request(f"lora_name: an adapter named {name!r} is already loaded", "lora_name", "already_loaded")
    path = Path(body.lora_path).expanduser()
    if not (path / "adapter_config.json").is_file():
        raise bad_request(f"lora_path: no adapter_config.json in {body.lora_path}", "lora_path")
    path = path.resolve()  # symbolic links followed: the check below is on where the files really are
    if path.is_relative_to(Path(ctx.config.state_dir).resolve()):
        raise APIError(403, "lora_path: adapters in the server's state directory belong to tenants; each is served "
                       "to its owner under its fine-tuned model name", "lora_path", "lora_path_forbidden")
    try:
        await load_adapter(ctx.client.loop, name, path)
    except AdapterError as e:
        raise bad_request(f"lora_path: {e}", "lora_path", "invalid_adapter") from e
    ctx.models.add_shared(name)
    return {"object": "lora_adapter", "lora_name": name, "status": "loaded"}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, ctx: ServerContext = Depends(context)):
    if not ctx.config.allow_lora_loading:
        raise APIError(403, "Runtime LoRA loading is off; start the server with --allow-lora-loading",
                       code="lora_loading_disabled")
    if body.lora_name not in ctx.models.shared:
        raise not_found("model", body.lora_name, "lora_name")
    try:
        await on_engine_async(ctx.client.loop, lambda: ctx.engine.unload_adapter(body.lora_name))
    except AdapterError as e:
        raise APIError(409, str(e), "lora_name", "adapter_in_use") from e
    del ctx.models.shared[body.lora_name]
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}
