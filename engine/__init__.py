"""pagedq's inference engine: paged KV cache, continuous batching, Llama-family models."""

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
