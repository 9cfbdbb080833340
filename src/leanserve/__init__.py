"""leanserve: an LLM executor and OpenAI-compatible server with a lean, measured host path."""

from .engine.config import EngineConfig
from .engine.params import SamplingParams
from .llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
