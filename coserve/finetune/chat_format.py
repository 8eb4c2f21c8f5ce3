"""OpenAI chat fine-tuning records: validation, and which tokens of the rendered chat carry loss.

A record is ``{"messages": [{"role": ..., "content": ..., "weight": 0|1 (optional)}, ...]}``. The
conversation is rendered with the tokenizer's own chat template and tokenized without added special
tokens (templates that want a bos write it themselves). The loss covers each assistant message's
content and the end-of-turn token the template writes after it (``<|im_end|>`` for ChatML), not the
header (``<|im_start|>assistant\\n``) and not what follows the end-of-turn token (ChatML's ``\\n``).

Spans are found by rendering prefixes of the conversation: ``messages[:i]`` with the generation
prompt ends where assistant message ``i`` starts, ``messages[:i+1]`` ends where it ends. Both must be
text prefixes of the whole rendering (else the template is not prefix-stable: ``ValueError``). Their
token counts give the token spans when their tokens are prefixes of the whole conversation's tokens.
When they are not, because a BPE merge crosses a boundary (e.g. assistant content starting with
whitespace merges with the header's ``\\n``), the text is tokenized piece by piece at the boundaries,
as an inference server sees it (prompt tokens, then generated tokens); the pieces must decode to the
same text as the whole, else ``ValueError``.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant")


class EmptyCompletionError(ValueError):
    """A record that is well formed but has no token to learn (empty completion, or all cut off)."""


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def is_unicode_text(s: str) -> bool:
    """Whether ``s`` is Unicode text: JSON's ``"\\ud800"`` escape decodes to a lone UTF-16 surrogate, a ``str`` that
    no tokenizer, UTF-8 encoder or SQLite bind accepts."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


NOT_UNICODE = "holds an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF), which is not Unicode text"


def check_message(m: object, where: str) -> tuple[str, str]:
    """One chat message's ``(role, content)``; ``ValueError`` naming ``where`` (e.g. ``messages[2].role``)."""
    if not isinstance(m, dict):
        raise ValueError(f"{where}: expected an object, got {json_type(m)}")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        got = repr(role) if isinstance(role, str) else json_type(role)
        raise ValueError(f"{where}.role: {got} is not one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise ValueError(f"{where}.content: expected a string, got {json_type(content)}")
    if not is_unicode_text(content):
        raise ValueError(f"{where}.content: {NOT_UNICODE}")
    return role, content


def validate_messages(messages: object) -> tuple[list[dict[str, str]], list[bool]]:
    """Checks an OpenAI ``messages`` list.

    Returns the messages reduced to ``role`` and ``content`` (what the template sees) and, per
    message, whether it is trained (an assistant message whose ``weight`` is not 0). Raises
    ``ValueError`` naming the offending field, e.g. ``messages[2].role``.
    """
    if not isinstance(messages, list) or not messages:
        what = "an empty array" if isinstance(messages, list) else json_type(messages)
        raise ValueError(f"messages: expected a non-empty array of messages, got {what}")
    plain: list[dict[str, str]] = []
    trained: list[bool] = []
    for i, m in enumerate(messages):
        role, content = check_message(m, f"messages[{i}]")
        weight = m.get("weight", 1)
        if isinstance(weight, bool) or weight not in (0, 1):
            raise ValueError(f"messages[{i}].weight: expected 0 or 1, got {weight!r}")
        plain.append({"role": role, "content": content})
        trained.append(role == "assistant" and weight == 1)
    if not any(m["role"] == "assistant" for m in plain):
        raise ValueError("messages: no assistant message")
    if plain[0]["role"] == "assistant":
        raise ValueError("messages[0]: the conversation starts with an assistant message; "
                         "a system or user message must come first")
    return plain, trained


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], gen: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    except Exception as e:  # jinja raises its own types for a template that rejects the input
        raise ValueError(f"messages: the chat template fails ({type(e).__name__}: {e})") from e
    if not isinstance(text, str):
        raise ValueError(f"messages: the chat template returned {type(text).__name__}, not text")
    return text


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids of the tokenizer's special tokens (end-of-turn markers among them)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return ids


def encode_chat(messages: Any, tokenizer: PreTrainedTokenizerBase,
                train_on_prompt: bool = False) -> tuple[list[int], list[bool]]:
    """Token ids of a chat record and, per token, whether it is a loss token.

    With ``train_on_prompt`` every token is a loss token except those of ``weight: 0`` assistant
    messages. Raises ``EmptyCompletionError`` when every trained assistant message is empty (or
    none is trained), ``ValueError`` for a bad record or a template that is not prefix-stable.
    """
    msgs, trained = validate_messages(messages)
    if not any(t and m["content"].strip() for m, t in zip(msgs, trained)):
        raise EmptyCompletionError("messages: every assistant message is empty or has weight 0")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the tokenizer has no chat template")
    full = _render(tokenizer, msgs, gen=False)
    spans: list[tuple[int, int, bool]] = []  # (start char, end char, trained) per assistant message
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        head, upto = _render(tokenizer, msgs[:i], gen=True), _render(tokenizer, msgs[:i + 1], gen=False)
        for part, what in ((head, f"messages[:{i}] with the generation prompt"), (upto, f"messages[:{i + 1}]")):
            if not full.startswith(part):
                raise ValueError(f"messages[{i}]: the chat template is not prefix-stable "
                                 f"(the rendering of {what} is not a prefix of the whole conversation)")
        if spans and len(head) < spans[-1][1] or len(head) > len(upto):
            raise ValueError(f"messages[{i}]: the chat template is not prefix-stable "
                             f"(its assistant spans overlap)")
        spans.append((len(head), len(upto), trained[i]))

    cuts = sorted({0, len(full)} | {c for s, e, _ in spans for c in (s, e)})
    ids = _ids(tokenizer, full)
    count: dict[int, int] = {0: 0, len(full): len(ids)}
    for c in cuts[1:-1]:
        prefix = _ids(tokenizer, full[:c])
        if ids[:len(prefix)] != prefix:
            break
        count[c] = len(prefix)
    else:
        cuts = []  # every boundary falls between tokens of the whole rendering
    if cuts:  # a token straddles a boundary: tokenize piece by piece
        whole, ids = ids, []
        for a, b in zip(cuts, cuts[1:]):
            ids += _ids(tokenizer, full[a:b])
            count[b] = len(ids)
        if tokenizer.decode(ids) != tokenizer.decode(whole):
            raise ValueError("messages: the chat template is not token-prefix-stable and its pieces "
                             "do not tokenize back to the same text")

    specials = special_ids(tokenizer)
    mask = [train_on_prompt] * len(ids)
    for s, e, is_trained in spans:
        a, b = count[s], count[e]
        if not is_trained:
            mask[a:b] = [False] * (b - a)
            continue
        end = max((t + 1 for t in range(a, b) if ids[t] in specials), default=b)  # through end-of-turn
        mask[a:end] = [True] * (end - a)
    return ids, mask
