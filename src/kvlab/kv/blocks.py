"""The block pool: refcounts and the free queue.

A block with refcount 0 is free and sits in the free queue. Free blocks that still hold a cached prefix stay
findable until the queue hands them out again, so the queue order is the eviction order:

* blocks that hold nothing findable go to the *front*: reusing them first costs no cached state;
* blocks that hold a cached prefix go to the *back*: least recently freed is evicted first, and a request's
  blocks are released tail-first, so a prefix shared by many requests outlives their suffixes.

The pool knows nothing about what a block holds; the caller says where a released block goes.

With ``fair=True`` the caller also names the *owner* of each cached block it releases (the tenant whose request
let go of it), and eviction is fair between owners: when no free block is plain free memory, the block handed
out is the least recently freed one of the owner that holds the most cached free blocks (ties: the owner whose
oldest block is oldest). So a tenant that streams large prompts evicts its own cached blocks before anyone
else's, and a tenant holding no more of the evictable cache than the others keeps it. With a single owner
this is the plain LRU order, block for block.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable

_NOBODY = object()  # not an owner: the block holds no cached prefix (None is an owner, the default tenant)


class BlockPool:
    """``num_blocks`` blocks with refcounts and an O(1) free queue."""

    def __init__(self, num_blocks: int, fair: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.fair = fair
        self._refcount = [0] * num_blocks
        # OrderedDict is a doubly linked list in C: O(1) append at either end, O(1) removal of any block
        # (a free block revived by a prefix hit) and O(1) pop of the oldest. A plain dict would make
        # popping the oldest degrade as deleted entries pile up at its front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # fair: the cached free blocks of each owner, least recently freed first, and when each was freed.
        self._owner: dict[int, Hashable] = {}
        self._owned: dict[Hashable, OrderedDict[int, None]] = {}
        self._freed_at: dict[int, int] = {}
        self._clock = itertools.count()

    # -- queries ---------------------------------------------------------------------------------------
    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def is_free(self, block: int) -> bool:
        return block in self._free

    def num_free(self) -> int:
        return len(self._free)

    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used() / self.num_blocks

    def free_order(self) -> list[int]:
        """Free blocks in the order they would be handed out (eviction order)."""
        if not self._owner:
            return list(self._free)
        order = [b for b in self._free if b not in self._owner]
        owned = {o: OrderedDict(q) for o, q in self._owned.items()}
        while owned:
            o = self._busiest(owned)
            order.append(owned[o].popitem(last=False)[0])
            if not owned[o]:
                del owned[o]
        return order

    def owners(self) -> dict[Hashable, int]:
        """fair: each owner's cached free blocks (what eviction weighs)."""
        return {o: len(q) for o, q in self._owned.items()}

    # -- transitions -----------------------------------------------------------------------------------
    def take(self) -> int:
        """Hand out the block at the front of the free queue with refcount 1."""
        if not self._free:
            raise RuntimeError("block pool exhausted; callers must check num_free() first")
        block = next(iter(self._free))
        if block in self._owner:  # no plain free block is left (they sit in front): evict fairly
            block = next(iter(self._owned[self._busiest(self._owned)]))
            self._disown(block)
        del self._free[block]
        self._refcount[block] = 1
        return block

    def incref(self, block: int) -> int:
        """One more holder; a free block leaves the free queue (a prefix hit reviving it)."""
        if self._refcount[block] == 0:
            del self._free[block]
            self._disown(block)
        self._refcount[block] += 1
        return self._refcount[block]

    def decref(self, block: int) -> int:
        """One holder fewer. Returns the new refcount; at 0 the caller must call :meth:`release`."""
        if self._refcount[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than it was held")
        self._refcount[block] -= 1
        return self._refcount[block]

    def release(self, block: int, cached: bool, owner: Hashable = None) -> None:
        """Put a block whose refcount reached 0 into the free queue (back if it holds a cached prefix).
        ``owner``: whose cached block it is, for fair eviction (ignored unless ``fair``)."""
        if self._refcount[block] != 0:
            raise RuntimeError(f"block {block} released with refcount {self._refcount[block]}")
        self._free[block] = None
        if not cached:
            self._free.move_to_end(block, last=False)
        elif self.fair:
            self._owner[block] = owner
            self._owned.setdefault(owner, OrderedDict())[block] = None
            self._freed_at[block] = next(self._clock)

    def disown_all(self) -> None:
        """Free blocks that held a cached prefix hold none any more (a reset): plain free memory, in queue order."""
        self._owner.clear()
        self._owned.clear()
        self._freed_at.clear()

    def _busiest(self, owned: dict[Hashable, OrderedDict[int, None]]) -> Hashable:
        """The owner holding the most cached free blocks; a tie goes to the one whose oldest block is oldest."""
        return max(owned, key=lambda o: (len(owned[o]), -self._freed_at[next(iter(owned[o]))]))

    def _disown(self, block: int) -> None:
        owner = self._owner.pop(block, _NOBODY)
        if owner is _NOBODY:
            return
        queue = self._owned[owner]
        del queue[block]
        if not queue:
            del self._owned[owner]
        del self._freed_at[block]

    def drop_all(self, block: int) -> bool:
        """Zero the refcount whatever it is (the unsafe ``reference_counting=False`` free).

        Returns False when the block was already free: a stale table freeing it twice is tolerated.
        """
        if self._refcount[block] == 0:
            return False
        self._refcount[block] = 0
        return True
