"""pagedq's inference engine: paged KV cache, continuous batching, Llama-family models."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
