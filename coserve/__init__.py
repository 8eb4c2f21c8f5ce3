"""coserve: co-serving LLM inference and parameter-efficient finetuning on the same accelerators."""

from coserve.engine import LLM, CompletionOutput, EngineConfig, LLMEngine, RequestOutput
from coserve.scheduler import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
