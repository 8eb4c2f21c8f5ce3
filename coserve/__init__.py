"""coserve: co-serving LLM inference and parameter-efficient finetuning on the same accelerators."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Batch-invariant CPU GEMMs (coserve/model/batch_invariance.py): MKL reads this at its first call, so it is set
# before anything here can multiply; an explicit setting in the environment wins. What the environment had is
# kept for child processes too, for those that serve no inference and give MKL its own mode back.
os.environ.setdefault("COSERVE_MKL_CBWR_ORIGINAL", os.environ.get("MKL_CBWR", ""))
if os.environ.get("COSERVE_STRICT_GEMMS", "1") == "1":
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

# Public names load lazily, so that torch-free layers (scheduler, kvcache) import without torch.
_EXPORTS = {
    "LLM": "coserve.engine.llm",
    "LLMEngine": "coserve.engine.llm_engine",
    "EngineConfig": "coserve.engine.config",
    "RequestOutput": "coserve.engine.outputs",
    "CompletionOutput": "coserve.engine.outputs",
    "SamplingParams": "coserve.scheduler.sampling_params",
    "PoolingParams": "coserve.scheduler.pooling_params",
    "BeamSearchParams": "coserve.engine.beam_search",
    "FinetuneConfig": "coserve.finetune.config",
    "LoraConfig": "coserve.peft.config",
    "IA3Config": "coserve.peft.config",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from coserve.engine.beam_search import BeamSearchParams
    from coserve.engine.config import EngineConfig
    from coserve.engine.llm import LLM
    from coserve.engine.llm_engine import LLMEngine
    from coserve.engine.outputs import CompletionOutput, RequestOutput
    from coserve.finetune.config import FinetuneConfig
    from coserve.peft.config import IA3Config, LoraConfig
    from coserve.scheduler.pooling_params import PoolingParams
    from coserve.scheduler.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'coserve' has no attribute {name!r}")
