"""Block tables of requests: admit (with prefix sharing), append slots (with copy-on-write), fork, free.

The contract, per engine step:

1. the scheduler asks :meth:`KVCacheManager.lookup` how much of a prompt would hit (no side effect), then
   admits it with one :meth:`~KVCacheManager.allocate` call that shares the cached prefix, reserves the
   blocks of the whole prompt and hands out the slots of its first chunk; running requests get
   :meth:`~KVCacheManager.append_slots`; :meth:`~KVCacheManager.free` preempts. Each returns an
   :class:`Allocation` that says why it failed (:class:`AllocFailure`), and a failed call changes nothing;
2. the engine applies every ``copies`` list of the step to the storage, in the order they were returned
   (``Engine._execute``), then the runner runs the forward pass, which writes the K/V of every slot handed
   out;
3. only then does what was written become findable by later lookups (a same-step lookup must not share,
   or copy, slots that are not written yet): the engine runs steps inside ``with manager.step():``, which
   commits on a clean exit; :meth:`~KVCacheManager.commit_writes` is the same commit for hand-driven rigs;
4. finished requests are freed.

When copy-on-write copies are decided (``CacheConfig.cow_check``: at the write, or at allocate and fork) and
what the reserve of copy targets promises: :mod:`kvlab.kv.cow`.

Public and private blocks (``public_prefix_tokens``: a request's first ``public_prefix_tokens // block_size`` full
blocks are keyed without its salt) and promotion (``CacheConfig.promote_after``): docs/architecture.md, "The KV
manager's contract"; the keying itself is :class:`~kvlab.kv.hashing.Keying`.

Unsafe knobs (``CacheConfig.unsafe``) change exactly one rule each: ``copy_on_write=False`` writes into a
shared block in place, ``reference_counting=False`` makes :meth:`~KVCacheManager.free` release blocks other
tables still hold, ``verify_tokens=False`` trusts a hash key without comparing anything.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvlab.config import CacheConfig, blocks_for
from kvlab.instrument.trace import Trace
from kvlab.kv.allocation import Allocation, AllocFailure, KVStats
from kvlab.kv.blocks import BlockPool
from kvlab.kv.cow import CowReserve
from kvlab.kv.hashing import Keying, hash_block
from kvlab.kv.prefix import ROOT_CID, ChainLink, Match, PrefixIndex
from kvlab.kv.promotion import Popularity
from kvlab.kv.tables import TableState, TableViews

# Public keys remembered for promotion per block of the pool: enough for every block's chain several times over.
POPULARITY_KEYS_PER_BLOCK = 4


class KVCacheManager(TableViews):
    def __init__(self, config: CacheConfig, trace: Trace | None = None, block_nbytes: int = 0) -> None:
        """``block_nbytes``: the bytes of one block of the storage the copies are applied to
        (``KVStorage.block_nbytes``). The manager knows how many blocks it copies, and the storage knows their
        size: ``stats.cow_bytes`` is the product. It stays 0 for a manager driven without storage."""
        self.config = config
        self.block_nbytes = block_nbytes
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.trace = trace
        self.pool = BlockPool(config.num_blocks, fair=config.eviction == "fair")
        self.index: PrefixIndex | None = None
        if config.share_prefix:
            self.index = PrefixIndex(
                config.block_size,
                config.hash_algo,
                verify=config.verify_tokens,
                token_granularity=config.prefix_granularity == "token",
            )
        self.popularity: Popularity | None = None
        if config.share_prefix and config.promote_after is not None:
            self.popularity = Popularity(
                config.promote_after, POPULARITY_KEYS_PER_BLOCK * config.num_blocks, config.block_size
            )
        self.stats = KVStats()
        self.tables: dict[str, TableState] = {}
        # The copy-on-write reserve (kv.cow): writers per block, the copy targets set aside, unwritten eager copies.
        self.cow = CowReserve(config.num_blocks, config.copy_on_write and config.reference_counting)

    # -- lookup and allocate -------------------------------------------------------------------------
    def lookup(self, prompt_tokens: Sequence[int], cache_salt: str | None = None, public_prefix_tokens: int = 0) -> int:
        """How many leading tokens of this prompt (under this salt, with this public prefix) :meth:`allocate`
        would find cached. No side effect: LRU order, refcounts and stats are untouched."""
        prompt = list(prompt_tokens)
        return self._match(prompt, self._keying(prompt, cache_salt, public_prefix_tokens, keys=False)[0]).num_tokens

    def keying_of(
        self, prompt_tokens: Sequence[int], cache_salt: str | None = None, public_prefix_tokens: int = 0
    ) -> Keying:
        """The keying :meth:`allocate` would give this prompt now: its declared public blocks, or more where
        they are promoted (``CacheConfig.promote_after``). No side effect."""
        return self._keying(list(prompt_tokens), cache_salt, public_prefix_tokens, keys=False)[0]

    def _keying(
        self, prompt: list[int], cache_salt: str | None, public_prefix_tokens: int, keys: bool = True
    ) -> tuple[Keying, list[int]]:
        """The request's keying and, under promotion with ``keys``, the public keys of its full prompt blocks (an
        admission notes them; a lookup hashes only as far as the promoted prefix reaches)."""
        keying = Keying.of(cache_salt, public_prefix_tokens, self.block_size)
        if public_prefix_tokens > len(prompt):  # public blocks lie inside the prompt: generated tokens never are
            raise ValueError(f"public_prefix_tokens={public_prefix_tokens} exceeds the prompt's {len(prompt)} tokens")
        if self.popularity is None or cache_salt is None:
            return keying, []
        # Declared public blocks are never counted (they are public already): promotion goes on after them.
        start = keying.public_blocks
        pop = self.popularity
        public_keys = pop.public_keys(prompt) if keys else []
        promoted = pop.promoted_blocks(public_keys, start) if keys else pop.promoted_prefix(prompt, start)
        return (Keying(cache_salt, promoted) if promoted > start else keying), public_keys

    def _match(self, prompt: list[int], keying: Keying) -> Match:
        # At least one prompt token is recomputed: its forward pass yields the logits of the first output.
        return self.index.match(prompt, keying, len(prompt) - 1) if self.index and prompt else Match()

    def allocate(
        self,
        request_id: str,
        prompt_tokens: Sequence[int],
        cache_salt: str | None = None,
        num_tokens: int | None = None,
        public_prefix_tokens: int = 0,
        tenant: str | None = None,
    ) -> Allocation:
        """Admit a request: share its cached prefix, reserve blocks for the rest of its prompt and hand out
        the slots of its uncached prompt tokens, at most ``num_tokens`` of them (default: all).

        ``public_prefix_tokens`` (at most the prompt's length): its first ``public_prefix_tokens // block_size``
        blocks are public, found and stored under no salt (see the module docstring); 0: all are the salt's.
        ``num_cached_tokens`` is at most ``len(prompt) - 1``. ``tenant``: whose request it is, the one party
        promotion counts it as, whatever its salt (None: the default tenant). On failure nothing at all has changed.
        """
        prompt = list(prompt_tokens)
        if not prompt:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} is already allocated")
        keying, public_keys = self._keying(prompt, cache_salt, public_prefix_tokens)
        match = self._match(prompt, keying)
        failure, copies = self._admit(request_id, prompt, keying, match, tenant)
        if failure is not None:
            return Allocation(failure=failure)
        self.tables[request_id].public_keys = public_keys
        if self.popularity is not None:
            self.popularity.touch(public_keys[: keying.public_blocks])
        n = len(prompt) - match.num_tokens
        if num_tokens is not None:
            n = min(n, num_tokens)
        first = self.append_slots(request_id, prompt[match.num_tokens : match.num_tokens + n])
        if not first.ok:  # only unsafe settings or forks that broke the reserve promise get here
            # Undone as it was taken, one reference each: free() without reference counts would let go of the
            # hit blocks other requests still hold.
            self._let_go(request_id, force=False)
            return first
        self.stats.requests += 1
        public = keying.public_tokens(self.block_size)
        public_hit = match.num_tokens if public is None else min(public, match.num_tokens)
        if self.index is not None:
            self.stats.prefix_cache_queries += len(prompt)
            self.stats.prefix_cache_hits += match.num_tokens
            self.stats.prefix_cache_hits_public += public_hit
            self.stats.hit_blocks += len(match.blocks)
        return Allocation(first.slots, copies + first.copies, match.num_tokens, public_hit)

    def _admit(
        self, request_id: str, prompt: list[int], keying: Keying, match: Match, tenant: str | None
    ) -> tuple[AllocFailure | None, list[tuple[int, int]]]:
        """Take the table's blocks; returns the failure, or the copies to apply before any write."""
        bs = self.block_size
        num_full = len(match.hashes)
        partial = match.num_tokens > num_full * bs
        depth = match.num_tokens - num_full * bs
        # A partial hit whose block goes on with other tokens than this prompt's is copied now, not written
        # in place: the cached tokens after ``depth`` stay findable for whoever asks for them next.
        move = partial and self._clobbers(match.blocks[-1], depth, prompt[match.num_tokens :])
        # cow_check="allocate": a partial hit that another table holds too is copied now, not at the first write.
        eager = (
            self.config.cow_check == "allocate"
            and partial
            and not move
            and self.config.copy_on_write
            and self.pool.refcount(match.blocks[-1]) > 0
        )
        num_new = blocks_for(len(prompt), bs) - len(match.blocks) + move
        top_up = {
            b: self.cow.missing(b, self.pool.refcount(b) + 1, self.cow.writers(b) + (partial and b == match.blocks[-1]))
            for b in (match.blocks[:-1] if move else match.blocks)
        }
        free = self.pool.num_free() - len({b for b in match.blocks if self.pool.refcount(b) == 0})
        if num_new > free:
            return AllocFailure.TABLE_BLOCKS, []
        # The eager copy takes one of the copy targets set aside for the block, or (without reference counting,
        # so without a reserve) a free block of its own.
        fresh = eager and not self.cow.spares_of(match.blocks[-1]) + top_up.get(match.blocks[-1], 0)
        if num_new + sum(top_up.values()) + fresh > free:
            return AllocFailure.COW_SPARES, []

        # Hits leave the free queue before any new block is taken, so they cannot be evicted for them.
        for i, block in enumerate(match.blocks):
            rc = self._incref(block)
            tokens = bs if i < num_full else depth
            # verified: the block's tokens were compared with the prompt's, so what it holds is the reader's own
            # prefix (``kvlab trace explain`` tells such benign shared reads from contamination by it).
            verified = self.config.verify_tokens
            self._emit("hit", request_id, block, rc, tokens=tokens, partial=i >= num_full, verified=verified)
        blocks = list(match.blocks)
        copies: list[tuple[int, int]] = []
        if move:
            src, blocks[-1] = blocks[-1], self._take(request_id, purpose="cow")
            copies.append((src, blocks[-1]))
            self._count_copy()
            self._emit("cow", request_id, blocks[-1], 1, src=src, slots=depth)
            self._release(src, request_id, force=False, reason="cow", owner=tenant)
        blocks += [self._take(request_id) for _ in range(num_new - move)]
        for block, missing in top_up.items():
            self._add_spares(request_id, block, missing)
        req = TableState(prompt, keying, blocks, prompt[: match.num_tokens], list(match.hashes), tenant=tenant)
        self.tables[request_id] = req
        for block in self._written_blocks(req):
            self.cow.add_writer(block)
        if eager:
            self._copy_on_write(request_id, req, num_full, depth, copies, eager=True)
        return None, copies

    # -- append --------------------------------------------------------------------------------------
    def append_slots(self, request_id: str, token_ids: Sequence[int], num_draft: int = 0) -> Allocation:
        """Slots for the request's next ``len(token_ids)`` tokens; a failure (and no change) if the pool is short.

        Reserved blocks are used first, then new ones come from the pool. A target block held by other
        tables too is first copied (copy-on-write); the copies must be applied before the writes.

        ``num_draft``: the last this many tokens are a speculative draft. Their slots are handed out (and copied
        on write) like the others, but they do not become the request's tokens: the prefix index never records
        them, so a rejected draft can never be found or shared. Those the engine verifies are made the
        request's own by :meth:`accept_drafts`; the next write overwrites the rest.
        """
        req = self.table(request_id)
        new = list(token_ids)
        if not new:
            return Allocation()
        if not 0 <= num_draft < len(new) or (num_draft and len(req.tokens) + len(new) - num_draft < len(req.prompt)):
            raise ValueError(
                f"request {request_id!r}: num_draft={num_draft} must leave at least one verified token, and a "
                "draft starts after the prompt"
            )
        start, end = len(req.tokens), len(req.tokens) + len(new)
        verified_end = end - num_draft
        expected = req.prompt[start:end]
        if new[: len(expected)] != expected:
            raise ValueError(
                f"request {request_id!r}: tokens for positions {start}..{start + len(expected) - 1} differ "
                "from its prompt"
            )
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        table, copies_needed = self._blocks_needed(req, new, start)
        if table > self.pool.num_free():
            return Allocation(failure=AllocFailure.TABLE_BLOCKS)
        if table + copies_needed > self.pool.num_free():
            return Allocation(failure=AllocFailure.COW_SPARES)

        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        for i in range(first, last + 1):
            p0, p1 = max(start, i * bs), min(end, (i + 1) * bs)
            kept = p0 - i * bs  # slots of this block before the write, which the request keeps
            shared_in_place = False
            if i == len(req.blocks):
                req.blocks.append(self._take(request_id))
                self.cow.add_writer(req.blocks[i])
            elif self._must_copy(req.blocks[i]) or self._clobbers(req.blocks[i], kept, new[p0 - start : p1 - start]):
                self._copy_on_write(request_id, req, i, kept, copies)
            elif self.pool.refcount(req.blocks[i]) > 1:
                shared_in_place = True  # copy_on_write=False: the write lands in a block others read
            block = req.blocks[i]
            v1 = min(p1, verified_end)  # the draft's slots of this block are written but not recorded
            if v1 > p0:
                self._record(request_id, req, i, new[p0 - start : v1 - start], shared_in_place)
            elif shared_in_place and self.index is not None:
                self.index.forget(block)  # a draft landed in a block others read: it holds no one prefix now
            block_slots = list(range(block * bs + kept, block * bs + kept + (p1 - p0)))
            slots += block_slots
            self._emit("write", request_id, block, self.pool.refcount(block), slots=block_slots)
        self.cow.written(request_id, first, last)
        return Allocation(slots, copies)

    def _record(self, request_id: str, req: TableState, i: int, tokens: list[int], shared_in_place: bool) -> None:
        """``tokens``, written into table index ``i`` right after the request's tokens there, are its own now."""
        block = req.blocks[i]
        kept = len(req.tokens) - i * self.block_size
        req.tokens.extend(tokens)
        if self.index is not None:
            self._index_write(request_id, req, i, block, kept, shared_in_place)
        if len(req.tokens) == (i + 1) * self.block_size:  # the request will never write this block again
            self.cow.drop_writer(block)
            self._trim_reserve(block)

    def accept_drafts(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The first ``len(token_ids)`` tokens of the draft ``append_slots`` wrote last (``num_draft``) were
        verified: they are the request's own now, recorded by the prefix index and findable from the next commit.
        A block another table took hold of since the draft was written (a same-step hit on its committed part)
        is forgotten by the index rather than recorded: both hold it, so it holds no one prefix any more."""
        req = self.table(request_id)
        new = list(token_ids)
        bs = self.block_size
        start = len(req.tokens)
        if not new:
            return
        if blocks_for(start + len(new), bs) > len(req.blocks):
            raise ValueError(f"request {request_id!r}: {len(new)} accepted draft tokens were never given slots")
        for i in range(start // bs, (start + len(new) - 1) // bs + 1):
            p0, p1 = max(start, i * bs), min(start + len(new), (i + 1) * bs)
            self._record(request_id, req, i, new[p0 - start : p1 - start], self.pool.refcount(req.blocks[i]) > 1)

    def take_back(self, request_id: str, num_tokens: int) -> None:
        """Unsafe (``SpeculativeConfig.commit_rejected``): the request's last ``num_tokens`` tokens, recorded when
        their draft was written, were rejected. They leave its table's view, and its frontier block is a block
        it writes again; what the prefix index recorded of them stays, findable: the failure this reproduces."""
        req = self.table(request_id)
        bs = self.block_size
        keep = len(req.tokens) - num_tokens
        if not 0 <= keep <= len(req.tokens) or keep < len(req.prompt):
            raise ValueError(f"request {request_id!r}: cannot take back {num_tokens} of its {len(req.tokens)} tokens")
        for i in range(keep // bs, len(req.tokens) // bs):
            self.cow.add_writer(req.blocks[i])  # full again no more: it will be written
        del req.tokens[keep:]
        del req.hashes[keep // bs :]

    def _index_write(
        self, request_id: str, req: TableState, i: int, block: int, kept: int, shared_in_place: bool
    ) -> None:
        assert self.index is not None
        bs = self.block_size
        view = req.tokens[i * bs : (i + 1) * bs]  # the request's whole view of block i after the write
        full = len(view) == bs
        if full:
            parent = req.hashes[i - 1] if i else None
            req.hashes.append(hash_block(parent, view, req.keying.extra(i), self.config.hash_algo))
            salt = req.keying.namespace(i)
            if self.popularity is not None and salt is not None and i < len(req.public_keys):
                self.popularity.note(request_id, req.tenant, req.public_keys[i])  # a private block it computed
        if shared_in_place:
            # Other tables read this block, so it no longer holds any one consistent prefix.
            self.index.forget(block)
        else:
            self.index.record_write(
                block, self._link(req, i), view, kept, req.hashes[i] if full else None, req.keying.namespace(i)
            )

    def _blocks_needed(self, req: TableState, new: list[int], start: int) -> tuple[int, int]:
        """(new table blocks, copy targets not covered by the reserve) that writing ``new`` from ``start`` takes."""
        bs = self.block_size
        first, last = start // bs, (start + len(new) - 1) // bs
        table = max(0, last + 1 - len(req.blocks))
        need = 0
        spares: dict[int, int] = {}
        for i in range(first, min(last + 1, len(req.blocks))):
            block = req.blocks[i]
            if self._must_copy(block):
                left = spares.setdefault(block, self.cow.spares_of(block))
                if left:
                    spares[block] = left - 1
                else:
                    need += 1
            elif self._clobbers(block, max(start, i * bs) - i * bs, new[max(start, i * bs) - start :]):
                need += 1
        return table, need

    def _clobbers(self, block: int, kept: int, tokens: Sequence[int]) -> bool:
        """Would writing ``tokens`` at offset ``kept`` of ``block`` overwrite findable content with other
        tokens? Then the writer copies its ``kept`` slots to a block of its own instead, so the cached
        prefix stays findable until evicted (in place, it and every block chained after it would be lost)."""
        if self.index is None or not self.config.copy_on_write:
            return False
        c = self.index.content(block)
        if c is None or not self.index.is_cached(block):
            return False
        theirs = c.tokens[kept : c.committed]
        n = min(len(theirs), len(tokens))
        return n > 0 and theirs[:n] != list(tokens[:n])

    def _must_copy(self, block: int) -> bool:
        return self.config.copy_on_write and self.pool.refcount(block) > 1

    def _copy_on_write(
        self, request_id: str, req: TableState, i: int, kept: int, copies: list[tuple[int, int]], eager: bool = False
    ) -> None:
        """Give the request a block of its own for table index ``i``, holding its ``kept`` slots of the shared one
        (a spare of the reserve if there is one). ``eager``: made at allocate/fork time, not before a write."""
        src = req.blocks[i]
        dst = self.cow.take_spare(src)
        if dst is None:
            dst = self._take(request_id)
        if kept:  # nothing to copy when the write starts the block
            copies.append((src, dst))
            self._count_copy()
            if eager:
                self.stats.cow_copies_eager += 1
                self.cow.note_eager(request_id, i)
            self._emit("cow", request_id, dst, self.pool.refcount(dst), src=src, slots=kept)
        req.blocks[i] = dst
        self.cow.move_writer(src, dst)
        self._release(src, request_id, force=False, reason="cow", owner=req.tenant)

    def _link(self, req: TableState, i: int) -> ChainLink:
        if i == 0:
            return ChainLink(None, ROOT_CID, req.keying.extra(0))
        assert self.index is not None
        return ChainLink(req.hashes[i - 1], self.index.cid_of(req.blocks[i - 1]), req.keying.extra(i))

    # -- commit, fork, free, reset -------------------------------------------------------------------
    def commit_writes(self) -> int:
        """The K/V of every slot handed out so far is written: make it findable. Call once per step,
        after the forward pass and before freeing finished requests. Returns the blocks published."""
        if self.popularity is not None:
            self.stats.promotions += self.popularity.commit()
        return self.index.commit() if self.index is not None else 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """One engine step: what its slots hold becomes findable when the block exits cleanly; an exception
        that leaves the block skips the commit (the slots may never have been written). The engine catches a
        failed forward pass inside the block (``Engine._execute``), so the commit does run then: what keeps it
        from publishing unwritten slots is that the batch's requests are failed, hence freed, first, and a
        block whose last holder is freed drops its uncommitted tokens (``PrefixIndex.discard_pending``)."""
        yield
        self.commit_writes()

    def fork(self, parent_id: str, child_id: str) -> list[tuple[int, int]]:
        """The child shares every block of the parent, the partial last one included. Returns the copies to
        apply before either of them writes: none under ``cow_check="write"`` (the partial block is copied on
        write), the child's copy of it under ``"allocate"``."""
        if not self.config.copy_on_write and not self.config.unsafe:
            raise ValueError("fork without copy_on_write makes both requests write one block; needs unsafe=True")
        parent = self.table(parent_id)
        if child_id in self.tables:
            raise ValueError(f"request {child_id!r} is already allocated")
        for block in parent.blocks:
            self._emit("fork", child_id, block, self._incref(block), parent=parent_id)
        child = TableState(
            list(parent.prompt),
            parent.keying,
            list(parent.blocks),
            list(parent.tokens),
            list(parent.hashes),
            list(parent.public_keys),
            parent.tenant,
        )
        self.tables[child_id] = child
        for block in self._written_blocks(child):
            self.cow.add_writer(block)
        # Best effort: a fork must not fail, so its copy targets are set aside only while the pool has room.
        for block in dict.fromkeys(child.blocks):
            missing = self.cow.missing(block, self.pool.refcount(block), self.cow.writers(block))
            self._add_spares(child_id, block, min(missing, self.pool.num_free()))
        copies: list[tuple[int, int]] = []
        if self.config.cow_check == "allocate":
            n, bs = len(child.tokens), self.block_size
            for i in range(n // bs, len(child.blocks)):  # the blocks the child will write into
                block = child.blocks[i]
                # Without a target set aside or a free block, the copy is left to the write.
                if self._must_copy(block) and (self.cow.spares_of(block) or self.pool.num_free()):
                    self._copy_on_write(child_id, child, i, max(0, n - i * bs), copies, eager=True)
        self.stats.forks += 1
        return copies

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last first, so a prefix shared with others is evicted last."""
        self._let_go(request_id, force=not self.config.reference_counting)
        self.stats.frees += 1

    def _let_go(self, request_id: str, force: bool) -> None:
        """Let go of every block of the request's table, last first; ``force``: whatever else holds them."""
        req = self.tables.pop(request_id, None)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        frontier = len(req.tokens) // self.block_size
        for i in reversed(range(len(req.blocks))):
            if i >= frontier:
                self.cow.drop_writer(req.blocks[i])
            self._release(req.blocks[i], request_id, force=force, reason="free", owner=req.tenant)
        self.stats.cow_copies_unneeded += self.cow.forget(request_id)
        if self.popularity is not None:
            self.popularity.discard(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Refused (False, nothing changes) while any block is in use."""
        if self.pool.num_used():
            return False
        if self.index is not None:
            self.index.reset()
        self.pool.disown_all()
        if self.popularity is not None:
            self.popularity.reset()
        self.stats.resets += 1
        self._emit("reset")
        return True

    # -- internals -----------------------------------------------------------------------------------
    def _emit(
        self,
        op: str,
        request: str | None = None,
        block: int | None = None,
        refcount: int | None = None,
        **detail,
    ) -> None:
        if self.trace is not None:
            self.trace.emit(op, request, block, refcount, **detail)

    def _count_copy(self) -> None:
        self.stats.cow_copies += 1
        self.stats.cow_bytes += self.block_nbytes

    def _incref(self, block: int) -> int:
        rc = self.pool.incref(block)
        self.stats.peak_refcount = max(self.stats.peak_refcount, rc)
        return rc

    def _take(self, request_id: str, purpose: str = "table") -> int:
        block = self.pool.take()
        if self.index is not None and self.index.forget(block):
            self.stats.evictions += 1
            self._emit("evict", request_id, block, 0)
        self.stats.allocations += 1
        self.stats.peak_refcount = max(self.stats.peak_refcount, 1)
        self._emit("alloc", request_id, block, 1, purpose=purpose)
        return block

    def _release(self, block: int, request_id: str | None, force: bool, reason: str, owner: str | None = None) -> None:
        """One holder lets go of ``block``; at refcount 0 it is free, cached (findable) or not, and a cached one
        is ``owner``'s (the releasing request's tenant; CacheConfig.eviction="fair" weighs owners)."""
        if force:  # reference_counting=False: let go even if other tables still hold the block
            if not self.pool.drop_all(block):
                return  # already free: a second free of a block is tolerated, not an error
            rc = 0
        elif not self.config.reference_counting and self.pool.refcount(block) == 0:
            # A stale table whose block another holder's free already released, letting go of it again
            # (a copy-on-write away from it): tolerated like a second free, the block is free already.
            return
        else:
            rc = self.pool.decref(block)
        self._emit("free", request_id, block, rc, reason=reason)
        if rc == 0:
            cached = False
            if self.index is not None:
                self.index.discard_pending(block)
                if force:
                    # Without reference counts the pool cannot tell a cached-but-free block from one still
                    # read by others, so it keeps no cache of freed blocks: a freed block is plain free memory
                    # and is handed out next (a free list), which is how a use-after-free strikes quickly.
                    self.index.forget(block)
                cached = self.index.is_cached(block)
            self.pool.release(block, cached, owner)
        self._trim_reserve(block)

    def _written_blocks(self, req: TableState) -> list[int]:
        """The request's blocks it may still write: its partial frontier block and the reserved ones."""
        return req.blocks[len(req.tokens) // self.block_size :]

    def copies_due(self, block: int) -> int:
        """Copies-on-write still to come for this block: each writer but the last holder copies."""
        return self.cow.due(self.pool.refcount(block), self.cow.writers(block))

    def _add_spares(self, request_id: str, block: int, count: int) -> None:
        for _ in range(count):
            self.cow.add_spare(block, self._take(request_id, purpose="cow-reserve"))

    def _trim_reserve(self, block: int) -> None:
        for spare in self.cow.excess(block, self.pool.refcount(block)):
            self._release(spare, None, force=False, reason="cow-reserve")
