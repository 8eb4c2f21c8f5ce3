"""A real byte-level BPE tokenizer, trained deterministically on standard-library docstrings.

Random test models need a tokenizer that behaves like a production one (Llama-3 / Qwen2 style):
byte-level BPE, so any unicode text round-trips; a BOS token that the post-processor prepends;
ChatML special tokens and a chat template. The training corpus is the docstrings of a fixed list
of Python standard-library modules, gathered with :mod:`inspect` with members walked in sorted
name order, so the same Python build always yields the same corpus and hence the same vocabulary.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
#: Special tokens in id order: they take ids 0..4 of every vocabulary built here.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
THINK_START, THINK_END = "<think>", "</think>"
#: Reasoning tags (as Qwen3 and DeepSeek-R1 tokenizers have them): the last two ids of every vocabulary built here,
#: whole tokens that decoding keeps (not special), so that a reasoning parser can find where a model's reasoning ends.
THINK_TOKENS: tuple[str, ...] = (THINK_START, THINK_END)

#: ChatML: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, then the assistant header.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: The corpus: docstrings of these modules (and their public classes and functions), in this order.
CORPUS_MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "collections.abc", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email", "email.message", "email.utils", "enum", "fractions",
    "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "html", "html.parser", "http",
    "http.client", "http.server", "inspect", "io", "ipaddress", "itertools", "json", "logging",
    "logging.handlers", "math", "mimetypes", "operator", "os", "os.path", "pathlib", "pickle",
    "pprint", "queue", "random", "re", "sched", "secrets", "shlex", "shutil", "socket", "sqlite3",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "time", "timeit", "tokenize", "traceback", "types", "typing", "unittest", "unittest.mock",
    "urllib", "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "xml",
    "xml.etree.ElementTree", "zipfile", "zlib",
)


def _module_docstrings(module: ModuleType) -> list[str]:
    """Docstrings of ``module``, its public classes and functions, and their methods, in name order."""
    docs = [inspect.getdoc(module) or ""]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for attr_name, attr in sorted(vars(obj).items()):
                if attr_name.startswith("__"):
                    continue
                if inspect.isroutine(attr) or isinstance(attr, (property, staticmethod, classmethod)):
                    docs.append(inspect.getdoc(attr) or "")
    return docs


@functools.lru_cache(maxsize=1)
def training_corpus() -> tuple[str, ...]:
    """The deduplicated docstrings of :data:`CORPUS_MODULES`, in a stable order (about 0.6 MB)."""
    seen: set[str] = set()
    corpus: list[str] = []
    with warnings.catch_warnings():  # e.g. typing.io's DeprecationWarning when its doc is read
        warnings.simplefilter("ignore")
        for module_name in CORPUS_MODULES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # e.g. a Python built without sqlite3: skip it, the rest suffices
                continue
            for doc in _module_docstrings(module):
                if doc and doc not in seen:
                    seen.add(doc)
                    corpus.append(doc)
    return tuple(corpus)


@functools.lru_cache(maxsize=8)
def _build_cached(vocab_size: int) -> str:
    """The trained tokenizer, serialised (so every caller gets its own mutable copy)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, f"special token {token!r} is not id {i}"
    if tokenizer.get_vocab_size() == vocab_size - len(THINK_TOKENS):  # else too small a corpus: said by the caller
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    # Like Llama 3: byte-level offsets, then BOS prepended to every encoded text.
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, BOS_ID)],
        ),
    ])
    return tokenizer.to_str()


def build_tokenizer(vocab_size: int = 8192) -> Tokenizer:
    """A deterministic byte-level BPE tokenizer with exactly ``vocab_size`` tokens.

    Ids 0..4 are :data:`SPECIAL_TOKENS` (bos, eos, pad, im_start, im_end), 5..260 the 256 byte
    symbols, the last two :data:`THINK_TOKENS` (``<think>``, ``</think>``), the rest BPE merges learned from
    :func:`training_corpus`. Encoding prepends the bos
    token. Training runs once per ``vocab_size`` per process (well under a second); each call
    returns a fresh copy. Raises ``ValueError`` if ``vocab_size`` is too small for the special
    tokens and the byte alphabet, or too large for the corpus to reach.
    """
    minimum = len(SPECIAL_TOKENS) + 256 + len(THINK_TOKENS)
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(f"vocab_size: must be an integer >= {minimum}, got {vocab_size!r}")
    tokenizer = Tokenizer.from_str(_build_cached(vocab_size))
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"vocab_size: the training corpus only reaches {tokenizer.get_vocab_size()} "
                         f"tokens, not {vocab_size}")
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` contents for a tokenizer from :func:`build_tokenizer`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": int(model_max_length),
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` (created if needed).

    The result loads with ``transformers.AutoTokenizer.from_pretrained(out_dir)``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
