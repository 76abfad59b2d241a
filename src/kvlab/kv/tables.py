"""The KV manager's record of each request's block table (``TableState``) and the read-only views of the tables,
the pool, the copy-on-write reserve and the prefix index (``TableViews``) that the scheduler, the engine, the
runner, the invariants and the tests read. ``KVCacheManager`` (``kv.manager``) is the only writer: it builds
these views' state and makes every change to it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.kv.blocks import BlockPool
from kvlab.kv.cow import CowReserve
from kvlab.kv.hashing import Keying
from kvlab.kv.prefix import PrefixIndex


@dataclass
class TableState:
    """One request's table as the manager keeps it."""

    prompt: list[int]
    keying: Keying  # the extra keys and namespace of each block index (the cache salt, the public blocks)
    blocks: list[int]  # block table, including blocks reserved for the rest of the prompt (and a draft's)
    tokens: list[int]  # tokens at positions 0 .. num_computed-1 (never a speculative draft's)
    hashes: list[int]  # this request's own chain key of each full block of `tokens`
    public_keys: list[int] = field(default_factory=list)  # promotion: public keys of its full prompt blocks
    tenant: str | None = None  # the party promotion counts it as (None: the default tenant)


class TableViews:
    """Read-only views; ``KVCacheManager`` sets the state they read and is the only one to change it."""

    block_size: int
    num_blocks: int
    pool: BlockPool
    cow: CowReserve
    index: PrefixIndex | None
    tables: dict[str, TableState]  # request id -> its table

    def table(self, request_id: str) -> TableState:
        """The request's table (``KeyError`` for an unknown request)."""
        req = self.tables.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        return req

    def block_table(self, request_id: str) -> list[int]:
        return list(self.table(request_id).blocks)

    def num_computed_tokens(self, request_id: str) -> int:
        return len(self.table(request_id).tokens)

    def keying(self, request_id: str) -> Keying:
        """How the request's blocks are keyed: its salt and how many leading blocks are public."""
        return self.table(request_id).keying

    def has_request(self, request_id: str) -> bool:
        return request_id in self.tables

    def request_ids(self) -> list[str]:
        return list(self.tables)

    def num_free_blocks(self) -> int:
        """Free blocks, cached-but-free (evictable) ones included."""
        return self.pool.num_free()

    def num_evictable_blocks(self) -> int:
        """Free blocks that still hold a findable prefix: taking one evicts it."""
        return sum(self.is_cached(b) for b in self.pool.free_order())

    def free_order(self) -> list[int]:
        """Free blocks in the order they will be handed out: the eviction order (LRU among cached ones)."""
        return self.pool.free_order()

    def is_cached(self, block: int) -> bool:
        """Whether a prefix lookup can find this block right now."""
        return self.index is not None and self.index.is_cached(block)

    def findable(self) -> list[tuple[int, int]]:
        """(block, committed tokens) of every block a prefix lookup can find now: the slots a later request
        may read without having written them."""
        return [] if self.index is None else self.index.findable()

    def usage(self) -> float:
        """Fraction of blocks with refcount > 0."""
        return self.pool.usage()

    def refcount(self, block: int) -> int:
        return self.pool.refcount(block)

    def cow_reserve(self) -> dict[int, list[int]]:
        """Shared block -> blocks set aside for its copies-on-write."""
        return self.cow.snapshot()

    def writers(self, block: int) -> int:
        """How many tables hold this block with a view that is not full (they may still write into it)."""
        return self.cow.writers(block)
