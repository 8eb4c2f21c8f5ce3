"""How to sample a request's tokens (the vLLM ``SamplingParams`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from coserve.guided.compilers import COMPILERS


MIN_TEMPERATURE = 1e-2  # a positive temperature below this is raised to it (as vLLM does)


def sequence_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's ``index``-th sequence (``n`` choices, ``best_of`` candidates): ``seed + index``,
    wrapping within int64 (what a torch generator takes); None stays None."""
    return None if seed is None else (seed + index + 2**63) % 2**64 - 2**63


def truncated_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the model's context, as vLLM reads
    it); None keeps it whole. ValueError naming the field where ``keep`` is more than the context."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens: {keep} is more than the model's context of {max_model_len} "
                         f"tokens")
    return ids[-keep:]


def check_truncate_prompt_tokens(keep: object) -> None:
    """``truncate_prompt_tokens`` is None, -1 or a positive integer (a ValueError naming it otherwise)."""
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or not (keep == -1 or keep >= 1)):
        raise ValueError(f"truncate_prompt_tokens must be None, -1 or a positive integer, got {keep!r}")


@dataclass(frozen=True, slots=True)
class ReasoningTokens:
    """A reasoning model's tags (single tokens) for one request, and whether its output begins inside the reasoning
    (the prompt left a ``<think>`` open); a structured output's guide starts where the reasoning ends."""

    start: int  # <think>
    end: int  # </think>
    opened: bool
    special: bool = False  # the tags are special tokens (Mistral's [THINK]): the output's text keeps special tokens
    #   whatever skip_special_tokens says, so that a parser finds them there

    def reply_start(self, output_ids: list[int]) -> int | None:
        """Where the reply after the reasoning begins in ``output_ids``, or None while the output is reasoning; 0 where
        there is none (nor yet any output: its first token may still open one, ``<think>``)."""
        if self.opened or (output_ids and output_ids[0] == self.start):
            try:
                return output_ids.index(self.end) + 1
            except ValueError:
                return None
        return 0

    def count(self, output_ids: list[int]) -> int:
        """How many of ``output_ids`` are reasoning, its tags included (all of them while it has not ended)."""
        begin = self.reply_start(output_ids)
        return len(output_ids) if begin is None else begin


@dataclass(frozen=True, slots=True)
class HarmonyTokens(ReasoningTokens):
    """gpt-oss's harmony messages (``coserve/server/harmony.py``) as reasoning tags: ``start`` is ``<|channel|>``,
    ``end`` ``<|end|>``; the reasoning is the ``analysis`` messages before the first message of another channel, whose
    header (``<|channel|>`` ... ``<|message|>``) ends it: a structured output's guide constrains that message's body."""

    message: int = -1  # <|message|>
    analysis: tuple[int, ...] = ()  # the channel name's tokens

    def reply_start(self, output_ids: list[int]) -> int | None:
        if not output_ids or output_ids[0] != self.start:  # no harmony header (yet): all reply
            return 0
        at = 0
        while True:  # each message: its header, then (an analysis one) its body to <|end|>
            try:
                channel = output_ids.index(self.start, at)
                message = output_ids.index(self.message, channel)
            except ValueError:
                return None
            if tuple(output_ids[channel + 1:message]) != self.analysis:
                return message + 1
            try:
                at = output_ids.index(self.end, message) + 1
            except ValueError:
                return None


class Reasoning(Protocol):
    """A reasoning parser as the engine's callers use it (``coserve/server/reasoning.py``'s ``ReasoningParser``)."""

    def tokens(self, prompt_ids: list[int]) -> ReasoningTokens:
        """The tags for a request with ``prompt_ids``, and whether its output begins inside the reasoning."""

    def split(self, tokens: ReasoningTokens, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, reply)`` of a whole output's text (None where there is none)."""


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings for one request; validated on construction, errors name the field."""

    max_tokens: int = 16  # tokens to generate at most
    n: int = 1  # vLLM's: sequences generated for the prompt (``LLM.generate`` runs each as a request, seed + i)
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # keep the k most likely tokens; -1 or 0 = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    seed: int | None = None  # per-request random seed; the same seed gives the same tokens
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens (kept in token_ids)
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens
    logprobs: int | None = None  # None = no logprobs; N = the sampled token's and the top-N's
    prompt_logprobs: int | None = None  # None = none; N = each prompt token's (after the first) and the top-N's
    presence_penalty: float = 0.0  # OpenAI's: subtracted from a token's logit once it has been generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time the token has been generated
    repetition_penalty: float = 1.0  # HF's/vLLM's: logits of tokens in the prompt or output divided (> 0) or
    #   multiplied (< 0) by it; 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI's: token id -> added to its logit
    min_p: float = 0.0  # vLLM's: after temperature, drop tokens less likely than min_p times the likeliest; 0 = off
    min_tokens: int = 0  # vLLM's: end-of-sequence and stop_token_ids are masked, and stop strings not sought, until
    #   this many tokens are out (a guided request's end-of-sequence is not masked: the guide decides)
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens it may sample; None = all
    include_stop_str_in_output: bool = False  # vLLM's: a stop string that ends the text is kept in it
    guided_json: dict | bool | None = None  # a JSON schema the output must match (vLLM's guided_json; OpenAI's
    #   response_format): the text is compact JSON (coserve/guided); None = free text
    guided_choice: list[str] | None = None  # vLLM's: the output is exactly one of these strings; None = free text
    guided_regex: str | None = None  # vLLM's: the whole output matches this regular expression; None = free text
    guided_grammar: str | None = None  # vLLM's: the whole output matches this GBNF or Lark grammar; None = free text
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words it may not write (each as the tokenizer
    #   splits it, with and without a leading space: the last token is banned where the output ends with the rest)
    bad_words_token_ids: list[list[int]] | None = None  # the engine's: ``bad_words`` tokenized (``bad_word_ids``)
    skip_special_tokens: bool = True  # vLLM's: the text leaves special tokens out (False: written as the tokenizer
    #   writes them, e.g. "<|im_end|>")
    truncate_prompt_tokens: int | None = None  # vLLM's: only the prompt's last k tokens are used (-1: as many as
    #   the model's context holds); None = the whole prompt
    reasoning: ReasoningTokens | None = None  # a reasoning parser's tags: a guide constrains only the reply after
    #   the reasoning (vLLM's structured outputs with --reasoning-parser); None = the guide constrains all of it

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n <= 0:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # smaller ones overflow the logits (NaN probabilities)
            self.temperature = MIN_TEMPERATURE
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a non-negative integer, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or a non-negative integer, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or a non-negative integer, got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if (not isinstance(self.repetition_penalty, (int, float)) or isinstance(self.repetition_penalty, bool)
                or not 0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be a positive number, got {self.repetition_penalty!r}")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
        if not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        given = [f for f in COMPILERS if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[-1]}: give one of guided_json, guided_choice, guided_regex and guided_grammar, "
                             f"not {len(given)}")
        for f in given:
            try:
                COMPILERS[f](getattr(self, f))
            except ValueError as e:
                raise ValueError(f"{f}: {e}") from None
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias: {token!r} is not a token id")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: the bias of token {token} must be a number in [-100, 100], got {bias!r}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether logits are penalised or biased before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens or self.allowed_token_ids is not None
                    or self.bad_words_token_ids)

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the request's tokens so far (penalties, or a guide's position)."""
        return self.adjusts_logits or self.guided

    @property
    def guided(self) -> bool:
        """Whether a guide decides which tokens may come (guided_json, guided_choice, guided_regex or
        guided_grammar)."""
        for f in COMPILERS:  # a loop, not any() over a generator: this runs for every request at every step
            if getattr(self, f) is not None:
                return True
        return False

    @property
    def speculable(self) -> bool:
        """Whether speculative decoding may run it: greedy, reading nothing per token (no logprobs, penalties,
        masks or guide) and with no stop strings (those are sought token by token in the text)."""
        return (self.greedy and self.logprobs is None and not self.reads_history and not self.stop
                and self.prompt_logprobs is None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
