"""The block pool: refcounts and the free queue.

A block with refcount 0 is free and sits in the free queue. Free blocks that still hold a cached prefix stay
findable until the queue hands them out again, so the queue order is the eviction order:

* blocks that hold nothing findable go to the *front*: reusing them first costs no cached state;
* blocks that hold a cached prefix go to the *back*: least recently freed is evicted first, and a request's
  blocks are released tail-first, so a prefix shared by many requests outlives their suffixes.

The pool knows nothing about what a block holds; the caller says where a released block goes.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """``num_blocks`` blocks with refcounts and an O(1) free queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        # OrderedDict is a doubly linked list in C: O(1) append at either end, O(1) removal of any block
        # (a free block revived by a prefix hit) and O(1) pop of the oldest. A plain dict would make
        # popping the oldest degrade as deleted entries pile up at its front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

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
        return list(self._free)

    # -- transitions -----------------------------------------------------------------------------------
    def take(self) -> int:
        """Hand out the block at the front of the free queue with refcount 1."""
        if not self._free:
            raise RuntimeError("block pool exhausted; callers must check num_free() first")
        block, _ = self._free.popitem(last=False)
        self._refcount[block] = 1
        return block

    def incref(self, block: int) -> int:
        """One more holder; a free block leaves the free queue (a prefix hit reviving it)."""
        if self._refcount[block] == 0:
            del self._free[block]
        self._refcount[block] += 1
        return self._refcount[block]

    def decref(self, block: int) -> int:
        """One holder fewer. Returns the new refcount; at 0 the caller must call :meth:`release`."""
        if self._refcount[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than it was held")
        self._refcount[block] -= 1
        return self._refcount[block]

    def release(self, block: int, cached: bool) -> None:
        """Put a block whose refcount reached 0 into the free queue (back if it holds a cached prefix)."""
        if self._refcount[block] != 0:
            raise RuntimeError(f"block {block} released with refcount {self._refcount[block]}")
        self._free[block] = None
        if not cached:
            self._free.move_to_end(block, last=False)

    def drop_all(self, block: int) -> bool:
        """Zero the refcount whatever it is (the unsafe ``reference_counting=False`` free).

        Returns False when the block was already free: a stale table freeing it twice is tolerated.
        """
        if self._refcount[block] == 0:
            return False
        self._refcount[block] = 0
        return True
