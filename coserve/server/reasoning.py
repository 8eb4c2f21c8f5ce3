"""Reasoning a model writes before its reply, between two tags (vLLM's ``--reasoning-parser``).

The parsers, by vLLM's names, differ in their tags and in where the output begins when the prompt does not say:
- ``deepseek_r1`` (DeepSeek-R1 and its distillations, whose chat template opens ``<think>`` in the prompt) and
  ``minimax_m2`` (MiniMax-M2): ``<think>`` ... ``</think>``; the output is reasoning until ``</think>``, all of it
  if that never comes;
- ``seed_oss`` (Seed-OSS): the same, between ``<seed:think>`` and ``</seed:think>``;
- ``qwen3`` (Qwen3, which writes ``<think>`` itself when it thinks, and whose template, with ``enable_thinking``
  false, closes an empty one in the prompt), ``glm45`` (GLM-4.5 and 4.6, the same switch) and ``deepseek_v3``
  (DeepSeek-V3.1 and later, whose template ends the prompt with ``<think>`` where ``thinking`` is asked for, and
  ``</think>`` where not): the output is reasoning from a leading ``<think>`` to ``</think>``, else all reply;
- ``mistral`` (Magistral): the same, between ``[THINK]`` and ``[/THINK]``, which are special tokens of its
  tokenizer: the text of a request it reads then keeps special tokens (``ReasoningTokens.special``), as vLLM's
  parser reads them;
- ``openai_gptoss`` (gpt-oss): its harmony messages, the ``analysis`` ones reasoning, the ``final`` one the reply
  (``harmony.py``; its markers are special tokens, kept in the text likewise), read from the output's text by
  ``HarmonySplit`` and from its tokens by ``HarmonyTokens``.
For every parser the prompt's last tag decides first: a prompt that leaves the reasoning open (its template wrote
the start tag) begins the output inside it, and one that closed it begins the output with the reply. The text after
the end tag is the reply (``content``), and the tags are dropped.

A stream and a whole reply are split by the same machine (``ReasoningSplit``), so that a stream's
``reasoning_content`` and ``content`` deltas add up to the whole reply's: vLLM's qwen3 parser, which splits a whole
reply at a ``</think>`` wherever it is but streams text before any tag as reasoning, can disagree with itself there.
The tags must be single tokens of the model's vocabulary (as vLLM requires): the engine then starts a structured
output's guide after the end tag, and the reasoning's tokens are counted by id (``reasoning_tokens``). Where they
are special tokens, the output's text keeps special tokens so that the split finds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from coserve.scheduler.sampling_params import HarmonyTokens, ReasoningTokens
from coserve.server import harmony

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ThinkFormat:
    """One parser's tags, and whether the output begins inside the reasoning where the prompt has no tag."""

    start: str
    end: str
    opened: bool


FORMATS = {
    "deepseek_r1": ThinkFormat(START, END, opened=True),
    "qwen3": ThinkFormat(START, END, opened=False),
    "glm45": ThinkFormat(START, END, opened=False),
    "deepseek_v3": ThinkFormat(START, END, opened=False),
    "minimax_m2": ThinkFormat(START, END, opened=True),
    "seed_oss": ThinkFormat("<seed:think>", "</seed:think>", opened=True),
    "mistral": ThinkFormat("[THINK]", "[/THINK]", opened=False),
    "openai_gptoss": ThinkFormat(harmony.CHANNEL, harmony.END, opened=False),  # harmony.py's messages, not tags
}
HARMONY = "openai_gptoss"
PARSERS = tuple(FORMATS)


class ReasoningParserError(ValueError):
    """A reasoning parser this model's tokenizer cannot serve."""


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One server's parser: its name, its tags, and their token ids in the model's vocabulary."""

    name: str
    start_id: int
    end_id: int
    special: bool = False  # the tags are special tokens (decoding skips them unless told not to)
    message_id: int = -1  # harmony's <|message|>
    analysis_ids: tuple[int, ...] = ()  # harmony's analysis channel's name

    @property
    def tags(self) -> ThinkFormat:
        return FORMATS[self.name]

    def tokens(self, prompt_ids: list[int]) -> ReasoningTokens:
        """What the engine needs of a request with ``prompt_ids``: the tags, and whether its output begins inside
        the reasoning (the prompt's last tag opens one; with no tag, as the parser's format says)."""
        if self.name == HARMONY:  # a harmony prompt ends each message it holds: the output begins a new one
            return HarmonyTokens(self.start_id, self.end_id, False, True, self.message_id, self.analysis_ids)
        last = next((t for t in reversed(prompt_ids) if t in (self.start_id, self.end_id)), None)
        opened = last == self.start_id or (self.tags.opened and last is None)
        return ReasoningTokens(self.start_id, self.end_id, opened, self.special)

    def splitter(self, tokens: ReasoningTokens) -> ReasoningSplit | harmony.HarmonySplit:
        """The machine that splits the text of a request's output (``tokens``: ``tokens(prompt_ids)``)."""
        if self.name == HARMONY:
            return harmony.HarmonySplit()
        return ReasoningSplit(tokens.opened, self.tags.start, self.tags.end)

    def split(self, tokens: ReasoningTokens, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole reply (None where there is none)."""
        machine = self.splitter(tokens)
        reasoning, content = machine.feed(text, final=True)
        return (reasoning if machine.reasoned else None), (content or None)


def reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The parser ``name`` for ``tokenizer``; ``ReasoningParserError`` naming the flag where the name is unknown or the
    tags are not single tokens of the vocabulary."""
    if name not in PARSERS:
        raise ReasoningParserError(f"--reasoning-parser: {name!r} is not one of {', '.join(PARSERS)}")
    ids = []
    for tag in (FORMATS[name].start, FORMATS[name].end):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ReasoningParserError(
                f"--reasoning-parser {name}: the model's tokenizer has no single token for {tag!r} "
                f"(it encodes it as {len(encoded)} tokens); a reasoning model's tokenizer does")
        ids.append(encoded[0])
    special = any(tokenizer.decode([i], skip_special_tokens=True) != tag
                  for i, tag in zip(ids, (FORMATS[name].start, FORMATS[name].end)))
    if name != HARMONY:
        return ReasoningParser(name, ids[0], ids[1], special)
    message = tokenizer.encode(harmony.MESSAGE, add_special_tokens=False)
    if len(message) != 1:
        raise ReasoningParserError(f"--reasoning-parser {name}: the model's tokenizer has no single token for "
                                   f"{harmony.MESSAGE!r}; gpt-oss's does")
    return ReasoningParser(name, ids[0], ids[1], True, message[0],
                           tuple(tokenizer.encode("analysis", add_special_tokens=False)))


class ReasoningSplit:
    """Feeds a reply's text as it grows; each ``feed`` returns the new ``(reasoning, content)`` text.

    A tail that could still become a tag is held back until the next text (or the end) settles it.
    """

    def __init__(self, opened: bool, start: str = START, end: str = END) -> None:
        self.opened = opened  # the prompt left the reasoning open: the output begins inside it
        self.start, self.end = start, end  # the tags
        self.mode = "start"  # a leading start tag may still come (dropped, as vLLM's parsers drop it, opened or not)
        self.reasoned = opened  # whether any of the reply was reasoning
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning = ""
        if self.mode == "start":
            if text.startswith(self.start):
                text, self.mode, self.reasoned = text[len(self.start):], "reasoning", True
            elif self.start.startswith(text) and not final:  # nothing yet, or maybe the beginning of the tag
                self._held = text
                return "", ""
            else:
                self.mode = "reasoning" if self.opened else "content"
        if self.mode == "reasoning":
            end = text.find(self.end)
            if end < 0:
                keep = 0 if final else _tag_prefix(text, self.end)
                reasoning, self._held = text[:len(text) - keep], text[len(text) - keep:]
                return reasoning, ""
            reasoning, text, self.mode = text[:end], text[end + len(self.end):], "content"
        return reasoning, text


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (what may still become it)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0
