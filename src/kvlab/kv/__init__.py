"""Paged KV cache: block pool, verified prefix index, copy-on-write, storage layouts, invariants."""

from kvlab.kv.allocation import Allocation, AllocFailure, KVStats
from kvlab.kv.hashing import Keying
from kvlab.kv.invariants import InvariantError, check_invariants
from kvlab.kv.manager import KVCacheManager
from kvlab.kv.storage import KVStorage

__all__ = [
    "AllocFailure",
    "Allocation",
    "InvariantError",
    "KVCacheManager",
    "KVStats",
    "KVStorage",
    "Keying",
    "check_invariants",
]
