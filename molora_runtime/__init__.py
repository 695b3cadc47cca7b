"""MoLoRA runtime: model, hot-set, per-token routing and the engine (no HTTP here)."""

from molora_runtime.config import EngineConfig, HotSetConfig
from molora_runtime.engine.types import CompletionResult, GenerationRequest, SamplingParams

__all__ = [
    "LLM",
    "CompletionResult",
    "EngineConfig",
    "GenerationRequest",
    "HotSetConfig",
    "SamplingParams",
]


def __getattr__(name: str):  # lazy: importing the package stays cheap
    if name == "LLM":
        from molora_runtime.engine.llm import LLM

        return LLM
    raise AttributeError(name)
