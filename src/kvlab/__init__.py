"""kvlab: a small, honest LLM inference engine for studying shared state and isolation in the KV cache."""

from kvlab.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from kvlab.engine.engine import Engine, EngineStats
from kvlab.engine.llm import LLM
from kvlab.engine.request import CompletionOutput, RequestOutput
from kvlab.engine.sampling import InvalidRequestError, SamplingParams

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "ConfigError",
    "Engine",
    "EngineStats",
    "InvalidRequestError",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
