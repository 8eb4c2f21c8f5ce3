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
