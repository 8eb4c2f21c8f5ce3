"""The engine loop, the torch executor and the Python API."""

from coserve.engine.config import EngineConfig
from coserve.engine.llm import LLM
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "EngineConfig", "LLM", "LLMEngine", "RequestOutput"]
