"""The bytes each token id stands for, and a trie over them, for computing which tokens a guide allows.

Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen2, coserve's own) spell bytes with GPT-2's printable
stand-ins; SentencePiece vocabularies (Llama 2, Mistral) write ``▁`` for a space and ``<0xNN>`` for a
raw byte. Special tokens (the tokenizer's added tokens) stand for no text: a guide never allows them,
except end-of-sequence where the text is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

from transformers import PreTrainedTokenizerBase


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's map from its printable stand-in characters back to bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[bytes | None]:
    """For each id below ``vocab_size``: the bytes it decodes to, or None (special, unused or unknown)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
    special = set(tokenizer.all_special_ids) | {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    decoder = _byte_level_decoder()
    out: list[bytes | None] = [None] * vocab_size
    for i, piece in enumerate(pieces):
        if piece is None or i in special:
            continue
        if byte_level:
            try:
                out[i] = bytes(decoder[c] for c in piece)
            except KeyError:  # not a byte-level spelling: a token that stands for no text
                continue
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = bytes((int(piece[3:5], 16),))
        else:
            out[i] = piece.replace("\u2581", " ").encode()
    return [b if b else None for b in out]


@dataclass(slots=True)
class TrieNode:
    ids: list[int] = field(default_factory=list)  # tokens whose bytes end here
    children: dict[int, "TrieNode"] = field(default_factory=dict)


def build_trie(vocab: list[bytes | None]) -> TrieNode:
    """A trie of the tokens' bytes (ids of equal spellings share a node)."""
    root = TrieNode()
    for i, data in enumerate(vocab):
        if data is None:
            continue
        node = root
        for b in data:
            node = node.children.setdefault(b, TrieNode())
        node.ids.append(i)
    return root
