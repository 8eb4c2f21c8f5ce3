"""Turns token events into RequestOutputs: detokenization, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.engine.detokenizer import IncrementalText
from coserve.engine.outputs import CompletionOutput, RequestOutput
from coserve.scheduler import Request, TokenEvent, TokenLogprobs


@dataclass(slots=True)
class _RequestText:
    prompt: str | None
    logprobs: list[TokenLogprobs] | None
    detokenizer: IncrementalText
    text: str = ""  # once a stop string cut it: the text, frozen
    cut: bool = False
    stop_reason: str | int | None = None
    finish_reason: str | None = None
    before_min_tokens: int = 0  # characters out before min_tokens were: a stop string must end after them
    stop_token: bool = False  # a stop token (EOS, stop_token_ids) ended it: its text is not the output's (vLLM's)


class OutputProcessor:
    """Keeps each live request's text; reports which requests a stop string ended."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[str, _RequestText] = {}

    def add(self, request: Request, prompt: str | None) -> None:
        params = request.params
        skip = params.skip_special_tokens and not (params.reasoning is not None and params.reasoning.special)
        self._texts[request.request_id] = _RequestText(
            prompt, [] if params.logprobs is not None else None, IncrementalText(self.tokenizer, skip))

    def process(self, request: Request, event: TokenEvent) -> bool:
        """Record one new token; returns True when a stop string has just ended the request."""
        state = self._texts[request.request_id]
        if event.logprobs is not None and state.logprobs is not None:
            state.logprobs.append(event.logprobs)
        if event.finished:
            state.finish_reason = event.finish_reason
            if event.new_token_id in request.params.stop_token_ids:
                state.stop_reason = event.new_token_id
            state.stop_token = event.finish_reason == "stop" and not request.params.include_stop_str_in_output
        params = request.params
        if not params.stop:
            return False
        text = self._text(request, state, exact=True)
        if len(request.output_token_ids) < params.min_tokens:
            state.before_min_tokens = len(text)
            return False
        for stop in params.stop:
            at = text.find(stop, max(0, state.before_min_tokens - len(stop) + 1))
            if at >= 0:
                end = at + len(stop) if params.include_stop_str_in_output else at
                state.text, state.cut = text[:end], True  # frozen: later decodes keep the cut
                state.stop_reason = stop
                state.finish_reason = "stop"
                return not event.finished  # True: the scheduler must still end it
        return False

    def output(self, request: Request, finished: bool) -> RequestOutput:
        """The request's RequestOutput now; forgets it once finished."""
        state = self._texts[request.request_id]
        if finished and (request.finish_reason in ("abort", "error") or state.finish_reason is None):
            state.finish_reason = request.finish_reason  # ended by the scheduler or an abort
        completion = CompletionOutput(
            index=0, text=self._text(request, state, exact=finished), token_ids=list(request.output_token_ids),
            finish_reason=state.finish_reason if finished else None,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            stop_reason=state.stop_reason)
        if finished:
            del self._texts[request.request_id]
        prompt_logprobs = ([None, *request.prompt_logprobs] if request.params.prompt_logprobs is not None
                           else None)
        return RequestOutput(request.request_id, state.prompt, list(request.prompt_token_ids),
                             [completion], finished, request.num_preemptions, request.error, prompt_logprobs,
                             request.num_cached_tokens, request.embedding)

    @staticmethod
    def _text(request: Request, state: _RequestText, exact: bool) -> str:
        """The request's output text; until ``exact`` is asked for (the final output, stop strings), less an
        unfinished UTF-8 character at its end (``IncrementalText``). The token that stopped it (EOS, a stop token
        id) is left out of the text, as vLLM leaves it out (unless ``include_stop_str_in_output``): its text shows
        where ``skip_special_tokens`` is False, or where a stop token id is not a special token."""
        if state.cut:
            return state.text
        ids = request.output_token_ids
        return state.detokenizer.text(ids[:-1] if state.stop_token else ids, exact)
