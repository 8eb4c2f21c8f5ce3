"""Loading a model directory's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``)."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class TokenizerLoadError(ValueError):
    """A tokenizer that is missing or does not load."""


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The HF fast tokenizer of ``model_dir``; errors name the directory and file."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer.model").is_file():
        raise TokenizerLoadError(f"{model_dir}: no tokenizer.json (or tokenizer.model) in the model directory")
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad file
        raise TokenizerLoadError(f"{model_dir}: tokenizer does not load "
                                 f"({type(e).__name__}: {e})") from e
    finally:
        quiet.setLevel(level)


ONE_THREAD_CHARS = 16_384  # texts up to this long are encoded by the backend alone (see encode)


def encode(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer(text, add_special_tokens=...)["input_ids"]`` for one text. A fast tokenizer's ``__call__``
    sends even one text through the backend's batch path, which hands it to the tokenizers library's thread pool:
    waking those threads costs more than encoding a short text while the engine's threads hold the cores (a tenth
    of a millisecond idle, more under load, on every request's TTFT). So a short text is encoded by the backend
    on the calling thread; a long one still takes the batch path, which releases the GIL while it works (a
    megabyte prompt tokenized in a worker thread must not stall the event loop for a second)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or len(text) > ONE_THREAD_CHARS:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    return backend.encode(text, add_special_tokens=add_special_tokens).ids
