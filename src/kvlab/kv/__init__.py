"""Paged KV cache: block pool, verified prefix index, copy-on-write, storage layouts, sanitizer."""

from kvlab.kv.invariants import InvariantError, check_invariants
from kvlab.kv.manager import KVCacheManager, KVStats, SlotAllocation
from kvlab.kv.sanitizer import KVSanitizer, Violation, prefix_digests
from kvlab.kv.storage import KVStorage

__all__ = [
    "InvariantError",
    "KVCacheManager",
    "KVSanitizer",
    "KVStats",
    "KVStorage",
    "SlotAllocation",
    "Violation",
    "check_invariants",
    "prefix_digests",
]
