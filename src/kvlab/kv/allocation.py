"""What the KV manager's calls return and count (``kv.manager``): an ``Allocation`` of slots (or the
``AllocFailure`` that refused it, having changed nothing) and the running ``KVStats``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class AllocFailure(enum.Enum):
    """Why an allocation was refused (nothing changed)."""

    TABLE_BLOCKS = "not enough free blocks for the block table"
    COW_SPARES = "not enough free blocks for the copy-on-write targets of shared blocks"


@dataclass(frozen=True)
class Allocation:
    """Slots handed out for a request's next tokens, or why none could be."""

    slots: list[int] = field(default_factory=list)  # one slot (block * block_size + offset) per token, in order
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write copies, applied
    # BEFORE the writes
    num_cached_tokens: int = 0  # allocate(): prompt tokens found in the prefix cache
    num_public_cached_tokens: int = 0  # of which in public blocks (all of them without a salt)
    failure: AllocFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass
class KVStats:
    requests: int = 0  # successful allocate() calls
    allocations: int = 0  # blocks handed out by the pool (new blocks, CoW targets, CoW reserves)
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission (vLLM's name)
    prefix_cache_hits: int = 0  # of which found in the cache
    prefix_cache_hits_public: int = 0  # of which in public blocks (keyed without salt; all hits of salt-free requests)
    hit_blocks: int = 0
    cow_copies: int = 0  # blocks copied: copy-on-write, and cached blocks that a write would have overwritten
    cow_copies_eager: int = 0  # of which made at allocate()/fork() time (cow_check="allocate")
    cow_copies_unneeded: int = 0  # eager copies whose request was freed before it wrote into its copy
    cow_bytes: int = 0  # bytes those copies move: cow_copies x the storage's bytes per block (0: not given)
    evictions: int = 0  # findable blocks whose cached prefix was dropped to reuse them
    forks: int = 0
    frees: int = 0
    resets: int = 0
    promotions: int = 0  # public keys promoted (CacheConfig.promote_after)
    peak_refcount: int = 0  # the highest refcount any block reached

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
