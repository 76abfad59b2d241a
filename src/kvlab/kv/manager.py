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

Public and private blocks (``public_prefix_tokens`` of :meth:`~KVCacheManager.lookup` and
:meth:`~KVCacheManager.allocate`): a request's blocks are keyed by its :class:`~kvlab.kv.hashing.Keying`. Its first
``P = public_prefix_tokens // block_size`` full blocks are *public*: keyed with no salt, so a lookup under any salt
(any tenant) with the same tokens from position 0 finds them. From block ``P`` on its blocks are *private*: block
``P`` carries the salt and every later one inherits it through the hash chain, so only a lookup under the same
salt and the same ``P`` finds them. A partial block at the boundary is private (floor), and so is every block of
generated tokens (``public_prefix_tokens`` may not exceed the prompt). With ``P = 0`` the salt is in block 0, the
keying of every request before public prefixes existed. A reader that declares fewer public blocks than the
writer did cannot hit the writer's public blocks past its own declaration: its lookup there carries its salt.
That is conservative, never a leak. Eviction, LRU order, copy-on-write and reset treat public and private blocks
alike; ``stats.prefix_cache_hits_public`` counts the hit tokens that lay in public blocks. With
``CacheConfig.promote_after = K`` a salted request's leading blocks are also public where K distinct tenants
computed the same chain (:mod:`kvlab.kv.promotion`: the ``tenant`` given to :meth:`~KVCacheManager.allocate`, never
the salt, which a tenant chooses freely): its keying's public blocks are the larger of the two.

Unsafe knobs (``CacheConfig.unsafe``) change exactly one rule each: ``copy_on_write=False`` writes into a
shared block in place, ``reference_counting=False`` makes :meth:`~KVCacheManager.free` release blocks other
tables still hold, ``verify_tokens=False`` trusts a hash key without comparing anything.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvlab.config import CacheConfig, blocks_for
from kvlab.instrument.trace import Trace
from kvlab.kv.allocation import Allocation, AllocFailure, KVStats
from kvlab.kv.blocks import BlockPool
from kvlab.kv.cow import CowReserve
from kvlab.kv.hashing import Keying, hash_block
from kvlab.kv.prefix import ROOT_CID, ChainLink, Match, PrefixIndex
from kvlab.kv.promotion import Popularity

# Public keys remembered for promotion per block of the pool: enough for every block's chain several times over.
POPULARITY_KEYS_PER_BLOCK = 4


@dataclass
class _Request:
    prompt: list[int]
    keying: Keying  # the extra keys and namespace of each block index (the cache salt, the public blocks)
    blocks: list[int]  # block table, including blocks reserved for the rest of the prompt
    tokens: list[int]  # tokens at positions 0 .. num_computed-1
    hashes: list[int]  # this request's own chain key of each full block of `tokens`
    public_keys: list[int] = field(default_factory=list)  # promotion: public keys of its full prompt blocks
    tenant: str | None = None  # the party promotion counts it as (None: the default tenant)


class KVCacheManager:
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
        self._requests: dict[str, _Request] = {}
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
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already allocated")
        keying, public_keys = self._keying(prompt, cache_salt, public_prefix_tokens)
        match = self._match(prompt, keying)
        failure, copies = self._admit(request_id, prompt, keying, match, tenant)
        if failure is not None:
            return Allocation(failure=failure)
        self._requests[request_id].public_keys = public_keys
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
        req = _Request(prompt, keying, blocks, prompt[: match.num_tokens], list(match.hashes), tenant=tenant)
        self._requests[request_id] = req
        for block in self._written_blocks(req):
            self.cow.add_writer(block)
        if eager:
            self._copy_on_write(request_id, req, num_full, depth, copies, eager=True)
        return None, copies

    # -- append --------------------------------------------------------------------------------------
    def append_slots(self, request_id: str, token_ids: Sequence[int]) -> Allocation:
        """Slots for the request's next ``len(token_ids)`` tokens; a failure (and no change) if the pool is short.

        Reserved blocks are used first, then new ones come from the pool. A target block held by other
        tables too is first copied (copy-on-write); the copies must be applied before the writes.
        """
        req = self._require(request_id)
        new = list(token_ids)
        if not new:
            return Allocation()
        start, end = len(req.tokens), len(req.tokens) + len(new)
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
            req.tokens.extend(new[p0 - start : p1 - start])
            if self.index is not None:
                self._index_write(request_id, req, i, block, kept, shared_in_place)
            if p1 == (i + 1) * bs:  # the request will never write this block again
                self.cow.drop_writer(block)
                self._trim_reserve(block)
            block_slots = list(range(block * bs + kept, block * bs + kept + (p1 - p0)))
            slots += block_slots
            self._emit("write", request_id, block, self.pool.refcount(block), slots=block_slots)
        self.cow.written(request_id, first, last)
        return Allocation(slots, copies)

    def _index_write(
        self, request_id: str, req: _Request, i: int, block: int, kept: int, shared_in_place: bool
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

    def _blocks_needed(self, req: _Request, new: list[int], start: int) -> tuple[int, int]:
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
        self, request_id: str, req: _Request, i: int, kept: int, copies: list[tuple[int, int]], eager: bool = False
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

    def _link(self, req: _Request, i: int) -> ChainLink:
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
        parent = self._require(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} is already allocated")
        for block in parent.blocks:
            self._emit("fork", child_id, block, self._incref(block), parent=parent_id)
        child = _Request(
            list(parent.prompt),
            parent.keying,
            list(parent.blocks),
            list(parent.tokens),
            list(parent.hashes),
            list(parent.public_keys),
            parent.tenant,
        )
        self._requests[child_id] = child
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
        req = self._requests.pop(request_id, None)
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

    # -- queries -------------------------------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return list(self._require(request_id).blocks)

    def num_computed_tokens(self, request_id: str) -> int:
        return len(self._require(request_id).tokens)

    def keying(self, request_id: str) -> Keying:
        """How the request's blocks are keyed: its salt and how many leading blocks are public."""
        return self._require(request_id).keying

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[str]:
        return list(self._requests)

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

    # -- internals -----------------------------------------------------------------------------------
    def _require(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        return req

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

    def _written_blocks(self, req: _Request) -> list[int]:
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
