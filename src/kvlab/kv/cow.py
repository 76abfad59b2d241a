"""The copy-on-write reserve: how many copies of each shared block are still to come, and the blocks set aside
for them, so a prompt the manager admitted never fails half-way for want of a copy target.

Only the holders whose view of a block is not full write into it (it is their frontier block, or one reserved
for the rest of their prompt): they are its *writers*. With ``r`` holders and ``w`` writers at most
``min(w, r - 1)`` copies of the block will be made (the last holder writes in place); without copy-on-write or
reference counting the manager promises none. ``KVCacheManager.allocate`` and ``fork`` set that many *spares*
aside per shared block; a copy takes one; a block whose copies are no longer due gives its extra spares back
(``excess``). With ``cow_check="allocate"`` the reserve also remembers the eager copies a request has not
written into yet, which the stats count as unneeded when it is freed first.

When copy-on-write copies are decided (``CacheConfig.cow_check``), in the manager's calls:

* ``"write"`` (the default): ``append_slots`` copies a target block that other tables hold just before writing
  into it. ``allocate`` and ``fork`` only set the copy targets aside (this reserve), so a copy is made only if
  the write comes while the block is shared.
* ``"allocate"``: the request being admitted or forked copies at once every shared block it will write into,
  whether the write ever comes or not (it may be aborted, preempted, or finish first). A request writes only
  into blocks its view does not fill, so full blocks stay shared. The blocks copied are:

  - at ``allocate``: the *partial* last block of a token-granular prefix hit, when another table holds it too
    (a running request's frontier block, or a cached block that another request also hit). That is the block
    that "write" copies at the request's first write. (A partial hit whose block goes on with other tokens
    than this prompt's is copied at admission in both modes, so that the cached tokens stay findable.) With
    ``prefix_granularity="block"`` every hit is a full block, and admission copies nothing;
  - at ``fork``: the parent's partial frontier block, which both will write into. Blocks the parent holds
    reserved for the rest of its prompt (a fork mid-prefill) are swapped for fresh ones, and nothing is
    copied. A fork must not fail, so a copy that finds no free block is left to the write, as under "write".

  One copy stays at write time in both modes: a block that a request is still writing into (it reached the
  block through a partial hit) and that a later request's hit reads whole. The later request never writes
  that block. Copying it for the writer at the later admission would copy slots that the writer's own writes
  of the same step have not filled yet, so the writer copies at its next write, into a target reserved now.

  The engine hands out the first chunk's slots in the same ``allocate`` call, so at admission both modes copy
  the same block at the same moment. The modes differ at forks, and for hand-driven admissions that get no
  slots. ``kv.allocation.KVStats`` counts the copies made at allocation (``cow_copies_eager``), and those whose
  request was freed before it wrote into its copy (``cow_copies_unneeded``).

This class keeps the counts and the lists; it takes and releases no block. The manager does that
(``kv.manager``), and the invariants (``kv.invariants``) check the counts against the tables.
"""

from __future__ import annotations


class CowReserve:
    """Writers per block, spares per shared block, and each request's unwritten eager copies.

    ``promises``: copy-on-write and reference counting both on (else no copy is due, and nothing is set aside).
    """

    def __init__(self, num_blocks: int, promises: bool) -> None:
        self.promises = promises
        self._writers = [0] * num_blocks
        self._spares: dict[int, list[int]] = {}
        self._unwritten: dict[str, set[int]] = {}

    # -- writers
    def writers(self, block: int) -> int:
        """How many tables hold ``block`` with a view that is not full (they may still write into it)."""
        return self._writers[block]

    def add_writer(self, block: int) -> None:
        self._writers[block] += 1

    def drop_writer(self, block: int) -> None:
        self._writers[block] -= 1

    def move_writer(self, src: int, dst: int) -> None:
        """A writer copied ``src`` to ``dst`` and writes there now."""
        self._writers[src] -= 1
        self._writers[dst] += 1

    # -- the promise and its spares
    def due(self, refcount: int, writers: int) -> int:
        """Copies still to come for a block of ``refcount`` holders, ``writers`` of them writing."""
        return max(0, min(writers, refcount - 1)) if self.promises else 0

    def missing(self, block: int, refcount: int, writers: int) -> int:
        """Spares ``block`` would still need with ``refcount`` holders and ``writers`` writers."""
        return max(0, self.due(refcount, writers) - self.spares_of(block))

    def spares_of(self, block: int) -> int:
        return len(self._spares.get(block, ()))

    def add_spare(self, block: int, spare: int) -> None:
        self._spares.setdefault(block, []).append(spare)

    def take_spare(self, block: int) -> int | None:
        """A spare set aside for ``block``'s copy, or None where none is."""
        spares = self._spares.get(block)
        if not spares:
            return None
        spare = spares.pop()
        if not spares:
            del self._spares[block]
        return spare

    def excess(self, block: int, refcount: int) -> list[int]:
        """The spares ``block`` no longer needs at ``refcount`` holders, taken out (the caller releases them)."""
        spares = self._spares.get(block)
        if not spares:
            return []
        keep = self.due(refcount, self._writers[block])
        out = []
        while len(spares) > keep:
            out.append(spares.pop())
        if not spares:
            del self._spares[block]
        return out

    def snapshot(self) -> dict[int, list[int]]:
        """Shared block -> the blocks set aside for its copies (a copy of the lists)."""
        return {b: list(s) for b, s in self._spares.items()}

    # -- eager copies (cow_check="allocate")
    def note_eager(self, request_id: str, index: int) -> None:
        """``request_id`` copied table index ``index`` before writing into it."""
        self._unwritten.setdefault(request_id, set()).add(index)

    def written(self, request_id: str, first: int, last: int) -> None:
        """The request wrote table indices ``first..last``: its eager copies there were needed."""
        if unwritten := self._unwritten.get(request_id):
            unwritten.difference_update(range(first, last + 1))

    def forget(self, request_id: str) -> int:
        """The request is gone: how many of its eager copies it never wrote into."""
        return len(self._unwritten.pop(request_id, ()))
