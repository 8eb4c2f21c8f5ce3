"""OpenAI's Responses API (``POST /v1/responses``), served by the chat machinery.

A request becomes a chat request: ``instructions`` a system message, ``input`` (a string, or items: messages,
earlier ``function_call`` / ``custom_tool_call`` items and their ``*_output`` results) the conversation,
``text.format`` the response format, function and custom ``tools`` and ``tool_choice`` as on the chat API
(``coserve/server/tools.py``). The reply is a ``response`` object whose ``output`` holds one assistant
``message`` (``output_text``), ``function_call`` items, or a named custom tool's ``custom_tool_call``, after a
``reasoning`` item (``reasoning_text``) where the server's ``--reasoning-parser`` finds the model's reasoning;
streamed, the typed events OpenAI's clients read (``response.created`` ... ``response.reasoning_text.delta`` /
``response.output_text.delta`` /
``response.function_call_arguments.delta`` / ``response.custom_tool_call_input.delta`` ...
``response.completed``). Finished responses are stored (unless ``store`` is
false) in the server's SQLite state with their conversation, for the tenant alone: ``previous_response_id``
continues one (its instructions are not carried over, as OpenAI's are not), ``GET`` and ``DELETE
/v1/responses/{id}`` read and forget one, ``GET /v1/responses/{id}/input_items`` lists what it answered
(``coserve/server/response_items.py``). ``background`` responses run on the server, streamed or not, their events
kept for ``GET /v1/responses/{id}?stream=true`` (``coserve/server/background_responses.py``).
"""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from coserve.engine.outputs import RequestOutput
from coserve.server.choices import (Job, advance, close_all, count_outcomes, finish_reason, gather_all, new_job,
                                    streaming)
from coserve.server.context import ServerContext, context, tenant_of
from coserve.server.conversation_items import kept_items, messages_of, output_items, parse_items
from coserve.server.errors import APIError, bad_request, not_found
from coserve.server.inference_api import (chat_logprobs, make_request, max_tokens_for, messages_chars,
                                          off_loop_if_long, render_chat, sampling_params, submit)
from coserve.server.json_text import TextJSONRoute
from coserve.server.protocol import (ChatCompletionRequest, CustomChoice, FunctionChoice, FunctionTool, InputMessage,
                                     InputTokensRequest, ResponsesCustomTool, ResponsesRequest, list_page)
from coserve.server.paging import check_limit, page_after
from coserve.server.reasoning import ReasoningParser
from coserve.server.response_items import input_items, output_messages
from coserve.server.response_format import guided_schema
from coserve.server.tools import ToolPlan, tool_plan

router = APIRouter(route_class=TextJSONRoute)
# chat fields whose errors name the Responses API's own
PARAMS = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}


def input_messages(body: ResponsesRequest) -> list[dict]:
    """``input`` as chat messages (earlier calls as assistant ``tool_calls``, their outputs as ``tool`` messages)."""
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    if not items:
        raise bad_request("input: is empty", "input")
    return messages_of(items)


def chat_request(body: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat request a Responses API request stands for: its instructions, then ``conversation`` (the stored
    one it continues, and its own input)."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    fmt = body.text.format if body.text is not None else None
    response_format = None
    if fmt is not None:
        response_format = {"type": fmt.type}
        if fmt.type == "json_schema":
            spec = {"name": fmt.name, "strict": fmt.strict}
            if fmt.json_schema is not None:
                spec["schema"] = fmt.json_schema
            response_format["json_schema"] = spec
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
             if isinstance(t, FunctionTool) else {"type": "custom", "custom": _chat_custom(t)} for t in body.tools or []]
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, CustomChoice):
        choice = {"type": "custom", "custom": {"name": choice.name}}
    try:
        return ChatCompletionRequest.model_validate({
            "model": body.model or "", "messages": messages, "temperature": body.temperature, "top_p": body.top_p,
            "seed": body.seed, "response_format": response_format, "tools": tools or None, "tool_choice": choice,
            "parallel_tool_calls": body.parallel_tool_calls,
            "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None})
    except ValidationError as e:  # what the Responses API accepts and chat does not
        raise bad_request(f"input: {e.errors()[0]['msg']}", "input") from None


def _chat_custom(tool: ResponsesCustomTool) -> dict:
    """A Responses API custom tool as the chat API writes it (its grammar one level down)."""
    out: dict = {"name": tool.name, **({"description": tool.description} if tool.description else {})}
    fmt = tool.format
    if fmt is not None:
        out["format"] = ({"type": "text"} if fmt.type == "text" else
                         {"type": "grammar", "grammar": {"definition": fmt.definition, "syntax": fmt.syntax}})
    return out


def _renamed(e: APIError) -> APIError:
    """A chat error, naming the Responses API's field."""
    param = e.param
    for chat, ours in PARAMS.items():
        if param is not None and param.startswith(chat):
            param = ours + param[len(chat):]
            break
    message = e.message.replace("response_format", "text.format") if e.param == "response_format" else e.message
    return APIError(e.status, message, param, e.code, e.type)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, ctx: ServerContext = Depends(context)):
    tenant = tenant_of(request)
    if body.background and body.store is False:
        raise bad_request("background: a background response is stored for GET to read: leave store true",
                          "background")
    history, conversation_id = _history(ctx, tenant, body)
    try:
        adapter = await ctx.models.resolve(tenant, body.model)
        conversation, chat, ids = await _prompt(ctx, body, history)
        max_tokens = max_tokens_for(ctx, len(ids), body.max_output_tokens, "max_output_tokens", "input")
        tools = tool_plan(chat, ctx.config.tool_call_parser)
        if tools is not None and not tools.auto:
            guided = tools.guide()
        else:
            schema = guided_schema(chat.response_format)
            guided = None if schema is None else {"guided_json": schema}
        reasoning = ctx.reasoning.tokens(ids) if ctx.reasoning is not None else None
        num_top = (body.top_logprobs or 0) if wants_logprobs(body) else None
        params = sampling_params(chat, max_tokens, num_top, 0, guided=guided, reasoning=reasoning,
                                 keep_special=tools is not None and tools.keeps_special)
        ctx.client.check_capacity(1)
        job = new_job(request, f"resp_{secrets.token_hex(12)}", body.model)
        job.reasoning = reasoning
        submit(ctx, job, [(make_request(ctx, tenant, ids, params, adapter, "input"), "")], body.stream)
    except APIError as e:
        raise _renamed(e) from None
    shape = ResponseShape(job, body, tools, tenant, conversation, ctx.reasoning,
                          (lambda items: chat_logprobs(ctx, items)) if num_top is not None else None, conversation_id)
    if body.background:
        queued = await ctx.background.start(ctx, shape)
        return event_stream(ctx.background.logs[job.ident].follow()) if body.stream else queued
    if body.stream:
        return streaming(shape.events(ctx), job, ctx)
    await gather_all(job, ctx, request)
    final = shape.response(job.choices[0].out)
    shape.keep(ctx, final)
    return final


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: InputTokensRequest, request: Request, ctx: ServerContext = Depends(context)):
    """OpenAI's count of a Responses request's input tokens: the prompt it would send (the stored conversation or
    previous response it goes on from, its instructions, tools and ``truncation``), not answered."""
    tenant = tenant_of(request)
    history, _ = _history(ctx, tenant, body)
    try:
        if body.model is not None:
            await ctx.models.resolve(tenant, body.model)
        _, _, ids = await _prompt(ctx, body, history)
    except APIError as e:
        raise _renamed(e) from None
    return {"object": "response.input_tokens", "input_tokens": len(ids)}


def _history(ctx: ServerContext, tenant: str, body: ResponsesRequest) -> tuple[list[dict], str | None]:
    """The messages a request goes on from (a stored conversation's, or a previous response's with its output),
    and the stored conversation's id where it names one."""
    if body.conversation is not None:  # a stored conversation goes on, and gains this response's input and output
        conversation_id = body.conversation if isinstance(body.conversation, str) else body.conversation.id
        if body.previous_response_id is not None:
            raise bad_request("conversation: cannot be used with previous_response_id", "conversation")
        items = ctx.store.conversation_items(tenant, conversation_id)
        if items is None:
            raise not_found("conversation", conversation_id, "conversation")
        return messages_of(parse_items(items, "conversation")), conversation_id
    if body.previous_response_id is not None:  # its conversation goes on (its instructions do not, as OpenAI's)
        stored = ctx.store.get_response(tenant, body.previous_response_id)
        if stored is None:
            raise not_found("response", body.previous_response_id, "previous_response_id")
        return stored[1], None
    return [], None


async def _prompt(ctx: ServerContext, body: ResponsesRequest, history: list[dict]
                  ) -> tuple[list[dict], ChatCompletionRequest, list[int]]:
    """The conversation (``history`` and the request's input), the chat request it stands for, and the prompt's
    token ids, its oldest messages dropped under ``truncation: auto``."""
    conversation = history + input_messages(body)
    chat = chat_request(body, conversation)
    ids = await off_loop_if_long(messages_chars(chat.messages), render_chat, ctx, chat)
    if body.truncation == "auto":
        chat, ids = await _truncated(ctx, body, conversation, chat, ids)
    return conversation, chat, ids


async def _truncated(ctx: ServerContext, body: ResponsesRequest, conversation: list[dict],
                     chat: ChatCompletionRequest, ids: list[int]) -> tuple[ChatCompletionRequest, list[int]]:
    """``truncation: auto``: the conversation's oldest messages dropped until the prompt leaves room for
    ``max_output_tokens`` (one token where not given) within the context; a call's results go with it. The last
    message is never dropped (a prompt still too long is the context's 400)."""
    room = ctx.engine.max_model_len - (body.max_output_tokens or 1)
    kept = conversation
    while len(ids) > room and len(kept) > 1:
        kept = kept[1:]
        while len(kept) > 1 and kept[0]["role"] == "tool":  # results of a call no longer there
            kept = kept[1:]
        chat = chat_request(body, kept)
        ids = await off_loop_if_long(messages_chars(chat.messages), render_chat, ctx, chat)
    return chat, ids


INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")  # the second: nothing to encrypt


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the reply text carries its tokens' logprobs (``include``, or ``top_logprobs`` given); a 400 naming an
    ``include`` value coserve does not know."""
    for i, name in enumerate(body.include or []):
        if name not in INCLUDABLE:
            raise bad_request(f"include[{i}]: {name!r} is not one of {', '.join(INCLUDABLE)}", f"include[{i}]")
    return "message.output_text.logprobs" in (body.include or []) or body.top_logprobs is not None


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False, starting_after: int | None = None,
                       ctx: ServerContext = Depends(context)):
    """The stored response; with ``stream``, a background response's events (after ``starting_after``), followed
    to its end."""
    stored = ctx.store.get_response(tenant_of(request), response_id)
    if stored is None:
        raise not_found("response", response_id)
    if stream:
        after = -1 if starting_after is None else starting_after
        return event_stream(ctx.background.events(response_id, stored[0], starting_after).follow(after))
    return stored[0]


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events read from a background response's log: a reader that goes away stops reading, and the
    response runs on."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, after: str | None = None,
                           limit: int = Query(20), order: str = Query("desc"), ctx: ServerContext = Depends(context)):
    """The items the stored response answered (its conversation before its output, instructions apart; a chained
    response's earlier turns included), newest first (``order=desc``) or oldest first, ``limit`` (1-100) after the
    item ``after``."""
    check_limit(limit, 100)
    if order not in ("asc", "desc"):
        raise bad_request(f"order: must be 'asc' or 'desc', got {order!r}", "order")
    stored = ctx.store.get_response(tenant_of(request), response_id)
    if stored is None:
        raise not_found("response", response_id)
    final, conversation = stored
    items = input_items(response_id, conversation[:len(conversation) - len(output_messages(final["output"]))])
    if order == "desc":
        items.reverse()
    return list_page(*page_after(items, after, limit, f"an input item of response {response_id}"))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request, ctx: ServerContext = Depends(context)):
    """Stop a background response (its stored object ``cancelled``); one that ended is returned as it ended."""
    return await ctx.background.cancel(ctx, tenant_of(request), response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, ctx: ServerContext = Depends(context)):
    if not ctx.store.delete_response(tenant_of(request), response_id):
        raise not_found("response", response_id)
    ctx.background.forget(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


class ResponseShape:
    """A response's JSON, its output items' ids fixed up front (so that streamed events and the final object agree)."""

    def __init__(self, job: Job, body: ResponsesRequest, tools: ToolPlan | None, tenant: str,
                 conversation: list[dict], reasoning: ReasoningParser | None = None, logprobs_of=None,
                 conversation_id: str | None = None) -> None:
        """``logprobs_of``: the chat API's form of token logprobs (OpenAI's output_text ``logprobs``), where asked;
        ``conversation_id``: the stored conversation (Conversations API) it goes on with."""
        self.job, self.body, self.tools = job, body, tools
        self.conversation_id = conversation_id
        self.logprobs_of = logprobs_of
        self.text_logprobs: list[dict] = []  # the reply text's, once the output has ended
        self.tenant, self.conversation = tenant, conversation
        self.parser = reasoning if job.reasoning is not None else None  # --reasoning-parser
        self.reasoning_id = f"rs_{secrets.token_hex(12)}"
        self.base = 0  # the reply's first output index: 1 after a streamed reasoning item
        self.pending = ""  # reply text a stream's reasoning phase read past the reasoning's end
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self.call_id = f"call_{secrets.token_hex(12)}"  # a named function's call
        self.item_id = f"{'ctc' if tools is not None and tools.custom else 'fc'}_{secrets.token_hex(12)}"
        self.streamed_call_ids: list[str] = []  # a listed call's call_id where a stream announced it
        self.call_item_ids: list[str] = []  # each listed call's item id, made as first needed
        self.final: dict | None = None  # the finished response, where a stream of listed calls read it
        self.failure: APIError | None = None  # what ended the events early, where something did

    @property
    def _named_events(self) -> str:
        """The streamed events of a named call's text: a function's arguments or a custom tool's input."""
        return "custom_tool_call_input" if self.tools.custom else "function_call_arguments"

    def call_item_id(self, i: int) -> str:
        while len(self.call_item_ids) <= i:
            self.call_item_ids.append(f"fc_{secrets.token_hex(12)}")
        return self.call_item_ids[i]

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, reply)`` of the whole text (no reasoning without a parser)."""
        if self.parser is None:
            return None, text
        thought, reply = self.parser.split(self.job.reasoning, text)
        return thought, reply or ""

    def reasoning_length(self, out: RequestOutput) -> int:
        """How many of the output's tokens are reasoning, its tags included (the reply's logprobs follow them)."""
        return self.job.reasoning.count(out.outputs[0].token_ids) if self.parser is not None else 0

    def items(self, out: RequestOutput) -> list[dict]:
        if self.logprobs_of is not None:
            self.text_logprobs = self.logprobs_of((out.outputs[0].logprobs or [])[self.reasoning_length(out):])
        (thought, text), reason = self.split(out.outputs[0].text), finish_reason(out)
        status = "incomplete" if reason == "length" else "completed"
        said = self.reply_items(text, reason, status)
        if thought is None:
            return said
        ended = self.parser.tags.end in out.outputs[0].text  # else the output ended inside its reasoning
        return [self.reasoning_item(thought, "completed" if ended else status), *said]

    def reasoning_item(self, text: str, status: str) -> dict:
        """The reasoning a model wrote before its reply (OpenAI's item for open-weight models' reasoning text)."""
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status,
                "content": [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]}

    def reply_items(self, text: str, reason: str | None, status: str) -> list[dict]:
        content, calls = self.tools.reply(text) if self.tools is not None and reason == "stop" else (text, [])
        if self.tools is not None and self.tools.function is not None:  # named: the output is the call's
            return [self.call_item(text, status)]
        if calls:
            said = [self.message(content, status)] if content else []  # auto: text the model wrote before calling
            ids = self.streamed_call_ids
            return said + [{"type": "function_call", "id": self.call_item_id(i),
                            "call_id": ids[i] if i < len(ids) else c["id"],
                            "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                            "status": "completed"} for i, c in enumerate(calls)]
        return [self.message(text, status)]

    def keep(self, ctx: ServerContext, final: dict) -> None:
        """Add the finished response's input and output to its stored conversation (``conversation``), and store it
        with its conversation (its output appended) unless ``store`` is false; a background response's stored state
        is replaced by it."""
        if self.conversation_id is not None:
            said = self.body.input if isinstance(self.body.input, list) else [
                InputMessage(role="user", content=self.body.input)]
            taken = ctx.store.conversation_item_ids(self.tenant, self.conversation_id) or set()
            added = kept_items(said, taken) + output_items(final["output"], taken)
            ctx.store.add_conversation_items(self.tenant, self.conversation_id, added)  # (deleted meanwhile: none)
        if self.body.store is False:
            return
        conversation = self.conversation + output_messages(final["output"])
        if self.body.background:
            ctx.store.replace_response(self.tenant, final, conversation)
        else:
            ctx.store.add_response(self.tenant, final, conversation)

    def message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_text_part(text, self.text_logprobs)]}

    def call_item(self, text: str, status: str) -> dict:
        """The named call's item: a function's (``arguments``) or a custom tool's (``input``)."""
        if self.tools.custom:
            return {"type": "custom_tool_call", "id": self.item_id, "call_id": self.call_id,
                    "name": self.tools.function, "input": text, "status": status}
        return {"type": "function_call", "id": self.item_id, "call_id": self.call_id, "name": self.tools.function,
                "arguments": text, "status": status}

    def response(self, out: RequestOutput | None, status: str | None = None) -> dict:
        """The response object: in progress without ``out``, else finished with its output and usage."""
        b = self.body
        if out is not None:
            status = "incomplete" if finish_reason(out) == "length" else "completed"
        choice = (b.tool_choice.model_dump() if isinstance(b.tool_choice, (FunctionChoice, CustomChoice))
                  else b.tool_choice or "auto")
        obj = {"id": self.job.ident, "object": "response", "created_at": self.job.created, "status": status,
               "model": b.model, "output": [] if out is None else self.items(out), "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
               "temperature": b.temperature, "top_p": b.top_p, "parallel_tool_calls": b.parallel_tool_calls,
               "tool_choice": choice, "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
               "text": b.text.model_dump(by_alias=True, exclude_none=True) if b.text else {"format": {"type": "text"}},
               "previous_response_id": b.previous_response_id, "store": b.store is not False,
               "conversation": None if self.conversation_id is None else {"id": self.conversation_id},
               "truncation": b.truncation or "disabled",
               "reasoning": {"effort": b.reasoning.effort if b.reasoning else None,
                             "summary": b.reasoning.summary if b.reasoning else None},
               "background": b.background,
               "metadata": b.metadata or {}, "user": b.user, "usage": None}
        if out is not None:
            n_in, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
            thought = self.job.reasoning.count(out.outputs[0].token_ids) if self.parser is not None else 0
            obj["usage"] = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": thought},
                            "total_tokens": n_in + n_out}
        return obj

    async def events(self, ctx: ServerContext) -> AsyncIterator[str]:
        """The streamed response: typed server-sent events, as OpenAI's Responses API sends them. A background
        response's start ``queued`` (``response.created``, ``response.queued``), and its failure is
        ``response.failed`` with the failed response (``failure`` holds why), as OpenAI's are."""
        seq = itertools.count()
        background = bool(self.body.background)

        def event(kind: str, **fields) -> str:
            data = json.dumps({"type": kind, "sequence_number": next(seq), **fields}, separators=(",", ":"))
            return f"event: {kind}\ndata: {data}\n\n"

        job, choice = self.job, self.job.choices[0]
        named = self.tools is not None and self.tools.function is not None
        listed = self.tools is not None and self.tools.listed  # calls (required, or auto's after any text)
        failed = False
        try:
            if background:
                yield event("response.created", response=self.response(None, "queued"))
                yield event("response.queued", response=self.response(None, "queued"))
            else:
                yield event("response.created", response=self.response(None, "in_progress"))
            yield event("response.in_progress", response=self.response(None, "in_progress"))
            if self.parser is not None:  # the reasoning first, as an item of its own where there is one
                async for e in self._reasoning_events(ctx, event):
                    yield e
            at = self.base
            if named:
                yield event("response.output_item.added", output_index=at, item=self.call_item("", "in_progress"))
            elif not listed:
                for e in self._open_message(event, at):
                    yield e
            if listed:
                async for e in self._listed_events(ctx, event):
                    yield e
            else:
                delta, self.pending = self.pending, ""
                logprobs_sent = None  # the output's tokens whose logprobs have gone (where asked): from the end of
                #   the reasoning, which has ended when the reply's text flows
                while True:
                    if delta:
                        choice.sent_text()
                    if delta and named:
                        yield event(f"response.{self._named_events}.delta", item_id=self.item_id, output_index=at,
                                    delta=delta)
                    elif delta:
                        fresh = []  # the tokens generated since the last delta, as the chat API's chunks carry them
                        if self.logprobs_of is not None and choice.out is not None:
                            tokens = choice.out.outputs[0].logprobs or []
                            if logprobs_sent is None:
                                logprobs_sent = self.reasoning_length(choice.out)
                            fresh, logprobs_sent = self.logprobs_of(tokens[logprobs_sent:]), len(tokens)
                        yield event("response.output_text.delta", item_id=self.message_id, output_index=at,
                                    content_index=0, delta=delta, logprobs=fresh)
                    if choice.out is not None and choice.out.finished:
                        break
                    out = await advance(choice, job, ctx)
                    delta = choice.delta.next(out.outputs[0].text, out.finished)
            final = self.final if listed else self.response(choice.out)
            if named:
                item = final["output"][at]
                said = {"input": item["input"]} if self.tools.custom else {"arguments": item["arguments"]}
                yield event(f"response.{self._named_events}.done", item_id=self.item_id, output_index=at, **said)
                yield event("response.output_item.done", output_index=at, item=item)
            elif not listed:
                for e in self._close_message(event, at, final["output"][at]):
                    yield e
            self.keep(ctx, final)
            yield event("response.completed" if final["status"] == "completed" else "response.incomplete",
                        response=final)
        except Exception as e:
            failed = True
            self.failure = e if isinstance(e, APIError) else APIError(
                500, f"generation failed ({type(e).__name__}: {e})")
            if background:
                yield event("response.failed", response=self.failed_response())
            else:
                yield event("error", code=self.failure.code, message=self.failure.message, param=self.failure.param)
        finally:
            await close_all(job)
            count_outcomes(job, ctx, "error" if failed else "cancelled")

    def failed_response(self) -> dict:
        """The response as ``failure`` ended it: ``failed``, naming why."""
        return {**self.response(None, "failed"), "error": {"code": "server_error", "message": self.failure.message}}

    async def _reasoning_events(self, ctx: ServerContext, event) -> AsyncIterator[str]:
        """The output up to the end of its reasoning: the reasoning item (opened at its first text, at index 0) with
        its text as it is written; the reply text read with the reasoning's end is kept for the reply's events."""
        job, choice = self.job, self.job.choices[0]
        split, said = self.parser.splitter(job.reasoning), ""
        while split.mode != "content" and not (choice.out is not None and choice.out.finished):
            out = await advance(choice, job, ctx)
            thought, self.pending = split.feed(choice.delta.next(out.outputs[0].text, out.finished), out.finished)
            if split.reasoned and not self.base:
                self.base = 1
                yield event("response.output_item.added", output_index=0, item=self.reasoning_item("", "in_progress"))
                yield event("response.content_part.added", item_id=self.reasoning_id, output_index=0,
                            content_index=0, part={"type": "reasoning_text", "text": ""})
            if thought:
                choice.sent_text()
                said += thought
                yield event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0,
                            content_index=0, delta=thought)
        if self.base:
            status = "incomplete" if finish_reason(choice.out) == "length" and split.mode != "content" else "completed"
            part = {"type": "reasoning_text", "text": said}
            yield event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=0, content_index=0,
                        text=said)
            yield event("response.content_part.done", item_id=self.reasoning_id, output_index=0, content_index=0,
                        part=part)
            yield event("response.output_item.done", output_index=0, item=self.reasoning_item(said, status))

    def _open_message(self, event, index: int):
        yield event("response.output_item.added", output_index=index, item=self.message("", "in_progress"))
        yield event("response.content_part.added", item_id=self.message_id, output_index=index, content_index=0,
                    part=_text_part(""))

    def _close_message(self, event, index: int, item: dict):
        text = "".join(p["text"] for p in item["content"])
        logprobs = [lp for p in item["content"] for lp in p.get("logprobs", [])]
        yield event("response.output_text.done", item_id=self.message_id, output_index=index, content_index=0,
                    text=text, logprobs=logprobs)
        yield event("response.content_part.done", item_id=self.message_id, output_index=index, content_index=0,
                    part=_text_part(text, logprobs))
        yield event("response.output_item.done", output_index=index, item=item)

    async def _listed_events(self, ctx: ServerContext, event) -> AsyncIterator[str]:
        """A reply of calls as it is written (``tool_stream.py``): the text before them as a message (opened at its
        first visible character), then each call as an item, its arguments in pieces; the final response's
        items carry the ids the stream announced. Where the finished text is not calls after all, the events
        sent stand and ``response.completed`` carries the reply as read from the finished text."""
        job, choice = self.job, self.job.choices[0]
        stream = self.tools.stream()
        self.streamed_call_ids = stream.ids  # the final items' call ids, for the calls announced here
        safe, held = "", ""  # the text no stop string can cut; message text not sent yet (blank so far)
        message, items = None, []  # the message's output index once open; the call items' output indexes

        def text_events(text: str):
            nonlocal held, message
            held += text
            if message is None and (items or not held.strip()):
                return  # blank text before the calls is not a message (as the finished reply reads it)
            if message is None:
                message = self.base
                yield from self._open_message(event, message)
            if held:
                yield event("response.output_text.delta", item_id=self.message_id, output_index=message,
                            content_index=0, delta=held, logprobs=[])
                held = ""

        def close_call(final_items: dict | None = None):
            i = len(items) - 1
            item = (final_items or {}).get(i) or {"type": "function_call", "id": self.call_item_id(i),
                                                  "call_id": stream.ids[i], "name": names[i],
                                                  "arguments": stream.arguments_sent[i], "status": "completed"}
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=items[i],
                        arguments=item["arguments"])
            yield event("response.output_item.done", output_index=items[i], item=item)

        def call_events(deltas: list[dict]):
            for d in deltas:
                i = d["index"]
                if "id" in d:
                    if message is not None and not items:  # the text is whole once a call begins
                        yield from self._close_message(event, message, self.message(safe_content(), "completed"))
                    if items:
                        yield from close_call()
                    names.append(d["function"]["name"])
                    items.append((self.base if message is None else message + 1) + len(items))
                    yield event("response.output_item.added", output_index=items[i], item={
                        "type": "function_call", "id": self.call_item_id(i), "call_id": d["id"],
                        "name": d["function"]["name"], "arguments": "", "status": "in_progress"})
                piece = d["function"].get("arguments", "")
                if piece:
                    yield event("response.function_call_arguments.delta", item_id=self.call_item_id(i),
                                output_index=items[i], delta=piece)

        def safe_content() -> str:
            return safe[:stream.content_sent]

        names: list[str] = []
        safe, self.pending = self.pending, ""
        while True:
            content, deltas = stream.update(safe)
            for e in text_events(content):
                yield e
            for e in call_events(deltas):
                yield e
            if choice.out is not None and choice.out.finished:
                break
            out = await advance(choice, job, ctx)
            safe += choice.delta.next(out.outputs[0].text, out.finished)
        final = self.final = self.response(choice.out)  # the reply as read from the finished text
        calls = [o for o in final["output"] if o["type"] == "function_call"]
        said = next((o for o in final["output"] if o["type"] == "message"), None)
        rest, deltas = stream.finish(self.split(choice.out.outputs[0].text)[1],
                                     None if said is None else said["content"][0]["text"],
                                     [{"id": o["call_id"], "function": {"name": o["name"], "arguments": o["arguments"]}}
                                      for o in calls])
        if not items:
            for e in text_events(rest):
                yield e
        for e in call_events(deltas):
            yield e
        if items:
            for e in close_call(dict(enumerate(calls))):
                yield e
        elif said is not None:
            if message is None:  # blank text and no call: the (empty) message is still an item
                message = self.base
                for e in self._open_message(event, message):
                    yield e
            for e in self._close_message(event, message, said):
                yield e


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
