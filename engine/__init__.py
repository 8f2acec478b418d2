"""pagedq's inference engine: paged KV cache, continuous batching, a registry of model families."""

import importlib
from typing import TYPE_CHECKING, Any

# Each name's module, imported on first use: `engine.config` alone (what the worker's and the
# gateway's command lines read) then costs torch, not the engine's whole import (llguidance,
# transformers), so a bad flag or URL is told seconds sooner.
_EXPORTS = {
    "EngineConfig": "engine.config",
    "LLM": "engine.llm",
    "EngineStats": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "CompletionOutput": "engine.outputs",
    "EmbeddingOutput": "engine.outputs",
    "EmbeddingRequestOutput": "engine.outputs",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "PoolingParams": "engine.pooling",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured_outputs",
}

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import EngineStats, LLMEngine
    from engine.outputs import (
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        RequestMetrics,
        RequestOutput,
    )
    from engine.pooling import PoolingParams
    from engine.sampling_params import SamplingParams
    from engine.structured_outputs import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    """The public names, from their modules on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "PoolingParams",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
