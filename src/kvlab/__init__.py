"""kvlab: a small, honest LLM inference engine for studying shared state and isolation in the KV cache.

The public names are imported on first use (PEP 562), so ``import kvlab`` — and ``kvlab --help`` — does
not pay for torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "kvlab.engine.llm",
    "CacheConfig": "kvlab.config",
    "CompletionOutput": "kvlab.engine.request",
    "ConfigError": "kvlab.config",
    "Engine": "kvlab.engine.engine",
    "EngineStats": "kvlab.engine.stats",
    "InvalidRequestError": "kvlab.engine.sampling",
    "ModelConfig": "kvlab.config",
    "RequestOutput": "kvlab.engine.request",
    "SamplingParams": "kvlab.engine.sampling",
    "SchedulerConfig": "kvlab.config",
}
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

if TYPE_CHECKING:
    from kvlab.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
    from kvlab.engine.engine import Engine
    from kvlab.engine.llm import LLM
    from kvlab.engine.request import CompletionOutput, RequestOutput
    from kvlab.engine.sampling import InvalidRequestError, SamplingParams
    from kvlab.engine.stats import EngineStats


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
