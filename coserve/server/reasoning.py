"""Reasoning a model writes before its reply, between ``<think>`` and ``</think>`` (vLLM's ``--reasoning-parser``).

``deepseek_r1``: DeepSeek-R1 and its distillations, whose chat template opens ``<think>`` in the prompt: the output
is reasoning until ``</think>``, all of it if that never comes. ``qwen3``: Qwen3, which writes ``<think>`` itself
when it thinks (and whose template, with ``enable_thinking`` false, closes an empty one in the prompt): the output is
reasoning from a leading ``<think>`` to ``</think>``, or from the start where the prompt left a ``<think>`` open;
else it is all reply. Either way the text after ``</think>`` is the reply (``content``), and the tags are dropped.

A stream and a whole reply are split by the same machine (``ReasoningSplit``), so that a stream's
``reasoning_content`` and ``content`` deltas add up to the whole reply's: vLLM's qwen3 parser, which splits a whole
reply at a ``</think>`` wherever it is but streams text before any tag as reasoning, can disagree with itself there.
The tags must be single tokens of the model's vocabulary (as vLLM requires): the engine then starts a structured
output's guide after ``</think>``, and the reasoning's tokens are counted by id (``reasoning_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

from coserve.scheduler.sampling_params import ReasoningTokens

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


class ReasoningParserError(ValueError):
    """A reasoning parser this model's tokenizer cannot serve."""


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One server's parser: its name and the tags' token ids in the model's vocabulary."""

    name: str
    start_id: int
    end_id: int

    def tokens(self, prompt_ids: list[int]) -> ReasoningTokens:
        """What the engine needs of a request with ``prompt_ids``: the tags, and whether its output begins inside
        the reasoning (the prompt's last tag opens one; always with ``deepseek_r1``, unless the prompt closed it)."""
        last = next((t for t in reversed(prompt_ids) if t in (self.start_id, self.end_id)), None)
        opened = last == self.start_id or (self.name == "deepseek_r1" and last is None)
        return ReasoningTokens(self.start_id, self.end_id, opened)

    def split(self, tokens: ReasoningTokens, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole reply (None where there is none)."""
        machine = ReasoningSplit(tokens.opened)
        reasoning, content = machine.feed(text, final=True)
        return (reasoning if machine.reasoned else None), (content or None)


def reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The parser ``name`` for ``tokenizer``; ``ReasoningParserError`` naming the flag where the name is unknown or the
    tags are not single tokens of the vocabulary."""
    if name not in PARSERS:
        raise ReasoningParserError(f"--reasoning-parser: {name!r} is not one of {', '.join(PARSERS)}")
    ids = []
    for tag in (START, END):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ReasoningParserError(
                f"--reasoning-parser {name}: the model's tokenizer has no single token for {tag!r} "
                f"(it encodes it as {len(encoded)} tokens); a reasoning model's tokenizer does")
        ids.append(encoded[0])
    return ReasoningParser(name, ids[0], ids[1])


class ReasoningSplit:
    """Feeds a reply's text as it grows; each ``feed`` returns the new ``(reasoning, content)`` text.

    A tail that could still become a tag is held back until the next text (or the end) settles it.
    """

    def __init__(self, opened: bool) -> None:
        self.opened = opened  # the prompt left the reasoning open: the output begins inside it
        self.mode = "start"  # a leading <think> may still come (dropped, as vLLM's parsers drop it, opened or not)
        self.reasoned = opened  # whether any of the reply was reasoning
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning = ""
        if self.mode == "start":
            if text.startswith(START):
                text, self.mode, self.reasoned = text[len(START):], "reasoning", True
            elif START.startswith(text) and not final:  # nothing yet, or maybe the beginning of <think>
                self._held = text
                return "", ""
            else:
                self.mode = "reasoning" if self.opened else "content"
        if self.mode == "reasoning":
            end = text.find(END)
            if end < 0:
                keep = 0 if final else _tag_prefix(text, END)
                reasoning, self._held = text[:len(text) - keep], text[len(text) - keep:]
                return reasoning, ""
            reasoning, text, self.mode = text[:end], text[end + len(END):], "content"
        return reasoning, text


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (what may still become it)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0
