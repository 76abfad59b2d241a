"""Paged KV cache: block pool, verified prefix index, copy-on-write, storage layouts, invariants."""

from kvlab.kv.invariants import InvariantError, check_invariants
from kvlab.kv.manager import KVCacheManager, KVStats, SlotAllocation
from kvlab.kv.storage import KVStorage

__all__ = [
    "InvariantError",
    "KVCacheManager",
    "KVStats",
    "KVStorage",
    "SlotAllocation",
    "check_invariants",
]
