"""Sizes the engine derives before it builds anything: the dtype K/V are stored in, the bytes of one pool block,
and the longest sequence the model and the pool can both hold (the one default every front end uses)."""

from __future__ import annotations

import torch

from kvlab.config import CacheConfig
from kvlab.kv import KVStorage
from kvlab.model.loader import LoadedModel

# kv_cache_dtype's names of the dtypes a cache may be stored in other than the model's.
STORAGE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a ``kv_cache_dtype`` name stores K/V in: the model's ("auto"), or one chosen apart (a bf16 cache
    halves its bytes, an fp8 one halves them again: each value rounded to 3 or 2 mantissa bits, unscaled)."""
    return model_dtype if name == "auto" else STORAGE_DTYPES[name]


def kv_rounding(stored: torch.dtype, computed: torch.dtype) -> torch.dtype | None:
    """The dtype a pool storing K/V in ``stored`` rounds them to when the model computes in ``computed`` (a
    narrower one: a bf16 or fp8 cache), or None where it keeps them as computed."""
    return stored if stored.itemsize < computed.itemsize else None


def kv_cache_dtype(cache: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``cache``'s pool stores K/V in (``storage_dtype`` of its ``kv_cache_dtype``)."""
    return storage_dtype(cache.kv_cache_dtype, model_dtype)


def kv_block_nbytes(loaded: LoadedModel, cache: CacheConfig) -> int:
    """Bytes of one pool block (its K and V in every layer), known before the pool is built."""
    cfg = loaded.config
    dtype = kv_cache_dtype(cache, loaded.model.dtype)
    return KVStorage.bytes_per_block(cfg.num_layers, cache.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)


def default_max_model_len(loaded: LoadedModel, cache: CacheConfig) -> int:
    """The longest sequence the model and the pool can both hold: the one default every front end uses. One
    block stays spare for the copy-on-write copy of a shared partial block, which admission reserves: a
    request of max_model_len tokens must be admissible, or max_tokens=None could never be served."""
    return min(loaded.config.max_position_embeddings, max(1, cache.num_blocks - 1) * cache.block_size)
