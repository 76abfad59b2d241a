"""Copy-on-write and its reserve, pinned down where the rest of the suite let a mutant through.

These tests were written against mutants that survived the suite (issue 40: the isolation-critical files). Each
one holds a guarantee a user of the KV manager relies on (a refcount, a block table, which block is copied, the
copy counters, the trace that ``kvlab trace explain`` reads, who owns a freed cached block under fair eviction,
the reserve's spares), and says which.
"""

from __future__ import annotations

from kv_rig import BS, Rig, cfg, clean

from kvlab.instrument.trace import Trace
from kvlab.kv import AllocFailure, KVCacheManager, check_invariants

A = [10, 11, 12, 13, 14, 15]  # block 0 full, block 1 holds [14, 15]


def _clobbered(rig: Rig, tenant: str | None) -> None:
    """A computes [0..7] and leaves it cached; B (``tenant``) revives both blocks through a 5-token hit on
    [0..5], writes its last prompt token 5 in place (the cached block holds it), then decodes 99 where the
    cached block holds 6: a write that would overwrite findable content, so B copies block 1 away."""
    rig.prefill("A", list(range(8)), tenant="owner-a")
    rig.free("A")
    assert rig.admit("B", [0, 1, 2, 3, 4, 5], tenant=tenant) == 5
    assert rig.feed("B", [5]).copies == []
    assert rig.m.block_table("B") == [0, 1]


# -- the copy a write makes ---------------------------------------------------------------------------------
def test_a_copy_without_a_spare_takes_its_target_in_the_writers_name() -> None:
    """A copy that finds no spare set aside takes a block from the pool: the trace's ``alloc`` of that target
    names the request that copies (``kvlab trace explain`` follows a block back to the request that took it)."""
    trace = Trace()
    rig = Rig(cfg(), trace)
    _clobbered(rig, None)
    alloc = rig.feed("B", [99])
    assert alloc.copies == [(1, 2)] and alloc.slots == [2 * BS + 2]
    assert rig.m.block_table("B") == [0, 2]
    [took] = trace.select(op="alloc", block=2)
    assert (took.request, took.refcount) == ("B", 1)
    [cow] = trace.select(op="cow")
    assert (cow.request, cow.block, cow.detail) == ("B", 2, {"src": 1, "slots": 2})
    [left] = trace.select(op="free", block=1, request="B")
    assert (left.refcount, left.detail) == (0, {"reason": "cow"})
    assert rig.m.is_cached(1) and rig.m.lookup(list(range(8)) + [9]) == 8  # A's prefix stays findable
    clean(rig, "B")


def test_a_cached_block_a_writer_copies_away_from_is_owned_by_the_writers_tenant() -> None:
    """Fair eviction weighs each tenant's cached free blocks: the block B copied away from (refcount 0, still
    cached) is counted as B's tenant's, the party whose request let go of it last."""
    rig = Rig(cfg(eviction="fair"))
    _clobbered(rig, "tenant-b")
    assert rig.m.pool.owners() == {}  # both of A's cached blocks are held again
    rig.feed("B", [99])
    assert rig.m.refcount(1) == 0 and rig.m.is_cached(1)
    assert rig.m.pool.owners() == {"tenant-b": 1}
    clean(rig, "B")


def test_each_eager_copy_is_counted() -> None:
    """Under cow_check="allocate" every fork copies the shared partial block at once: two forks, two eager copies."""
    rig = Rig(cfg(cow_check="allocate"))
    rig.prefill("P", A)
    parent = rig.m.block_table("P")[1]
    first = rig.fork("P", "C1")
    second = rig.fork("P", "C2")
    assert first == [(parent, rig.m.block_table("C1")[1])]
    assert second == [(parent, rig.m.block_table("C2")[1])]
    s = rig.m.stats
    assert (s.cow_copies, s.cow_copies_eager, s.cow_copies_unneeded) == (2, 2, 0)
    rig.free("C1")
    rig.free("C2")
    assert rig.m.stats.cow_copies_unneeded == 2
    clean(rig, "P")


def test_the_writers_count_stays_true_when_an_unsafe_free_lets_two_tables_write_one_block() -> None:
    """reference_counting=False frees a block another table still writes into; a copy that is then handed that
    block adds its writer to the one already there (the counts ``check_invariants`` compares with the tables)."""
    rig = Rig(cfg(reference_counting=False, unsafe=True))
    rig.prefill("P", [1, 2, 3, 4, 5, 6])
    rig.fork("P", "C")
    rig.free("C")  # frees P's blocks 0 and 1 too: P still holds and writes block 1
    assert rig.m.block_table("P") == [0, 1] and rig.m.writers(1) == 1
    rig.prefill("R", [100, 101])  # takes block 0
    rig.fork("R", "S")
    assert rig.feed("R", [102]).copies == [(0, 1)]  # R's copy target is block 1, which P writes too
    assert rig.m.block_table("R") == [1]
    assert [rig.m.writers(b) for b in range(3)] == [1, 2, 0]
    check_invariants(rig.m)


# -- the reserve -----------------------------------------------------------------------------------------------
def test_spares_are_taken_and_returned_under_their_own_name_in_the_trace() -> None:
    """A spare is taken in the admitted request's name with purpose "cow-reserve", and given back (no request)
    with reason "cow-reserve" once its copy is no longer due."""
    trace = Trace()
    rig = Rig(cfg(), trace)
    rig.prefill("A", A)
    assert rig.admit("B", [*A, 60]) == 6
    [spare] = rig.m.cow_reserve()[1]
    [took] = trace.select(op="alloc", block=spare)
    assert (took.request, took.refcount, took.detail) == ("B", 1, {"purpose": "cow-reserve"})
    rig.free("A")
    assert rig.m.cow_reserve() == {}
    [back] = trace.select(op="free", block=spare)
    assert (back.request, back.refcount, back.detail) == (None, 0, {"reason": "cow-reserve"})
    assert rig.m.refcount(spare) == 0 and spare in rig.m.free_order()
    clean(rig, "B")


def test_without_copy_on_write_no_copy_is_due_and_nothing_is_set_aside() -> None:
    """copy_on_write=False (unsafe) writes into shared blocks in place: no copy is ever due, so admission sets no
    block aside for one."""
    rig = Rig(cfg(copy_on_write=False, unsafe=True))
    rig.prefill("A", A)
    free = rig.m.num_free_blocks()
    assert rig.admit("B", [*A, 60]) == 6
    shared = rig.m.block_table("A")[1]
    assert rig.m.refcount(shared) == 2 and rig.m.writers(shared) == 2
    assert rig.m.copies_due(shared) == 0
    assert rig.m.cow_reserve() == {}
    assert rig.m.num_free_blocks() == free
    assert rig.m.stats.allocations == 2


# -- commit ------------------------------------------------------------------------------------------------------
def test_without_prefix_sharing_a_commit_publishes_nothing() -> None:
    m = KVCacheManager(cfg(share_prefix=False))
    m.allocate("A", A)
    assert m.commit_writes() == 0
    with m.step():
        assert m.append_slots("A", [16]).ok
    assert m.commit_writes() == 0


# -- allocate -------------------------------------------------------------------------------------------------
def test_by_default_no_block_of_a_salted_prompt_is_public() -> None:
    """Without ``public_prefix_tokens`` every block carries the salt, even one-token blocks: another salt with the
    same prompt finds nothing, the same salt finds it all (as far as a prompt may hit)."""
    m = KVCacheManager(cfg(block_size=1))
    assert m.allocate("A", [1, 2, 3], cache_salt="s1").ok
    m.commit_writes()
    assert m.keying("A").public_blocks == 0
    other = m.allocate("B", [1, 2, 3], cache_salt="s2")
    assert (other.num_cached_tokens, other.num_public_cached_tokens) == (0, 0)
    same = m.allocate("C", [1, 2, 3], cache_salt="s1")
    assert (same.num_cached_tokens, same.num_public_cached_tokens) == (2, 0)
    assert (m.stats.prefix_cache_hits, m.stats.prefix_cache_hits_public) == (2, 0)


def test_only_hits_inside_the_public_blocks_count_as_public() -> None:
    """A salted request with one public block (4 tokens) that hits 11 tokens hit 4 public ones: the Allocation
    and stats.prefix_cache_hits_public say 4, and every hit block is counted in stats.hit_blocks."""
    m = KVCacheManager(cfg())
    prompt = list(range(12))
    m.allocate("A", prompt, cache_salt="s", public_prefix_tokens=4)
    m.commit_writes()
    alloc = m.allocate("B", prompt, cache_salt="s", public_prefix_tokens=4)
    assert (alloc.num_cached_tokens, alloc.num_public_cached_tokens) == (11, 4)
    s = m.stats
    assert (s.prefix_cache_hits, s.prefix_cache_hits_public, s.hit_blocks) == (11, 4, 3)
    m.commit_writes()
    again = m.allocate("C", prompt[:6], cache_salt="s", public_prefix_tokens=4)
    assert (again.num_cached_tokens, again.num_public_cached_tokens) == (5, 4)
    assert (s.prefix_cache_hits, s.prefix_cache_hits_public, s.hit_blocks) == (16, 8, 5)


def test_an_admission_whose_first_chunk_is_refused_returns_the_failure_and_is_not_admitted() -> None:
    """Without reference counting there is no reserve, so an admission can pass and its first chunk still find no
    block for the copy it needs: allocate returns that failure and the request is not left half-admitted."""
    rig = Rig(cfg(num_blocks=6, reference_counting=False, unsafe=True))
    rig.prefill("A", A)
    rig.prefill("C", list(range(100, 116)))  # the pool is full
    alloc = rig.m.allocate("B", [*A, 60])  # B's write into the shared block 1 needs a copy target
    assert alloc.failure is AllocFailure.COW_SPARES
    assert (alloc.slots, alloc.copies) == ([], [])
    assert not rig.m.has_request("B") and rig.m.request_ids() == ["A", "C"]
    assert rig.m.stats.requests == 2
