"""Copy-on-write and its reserve, pinned down where the rest of the suite let a mutant through.

These tests were written against mutants that survived the suite (issue 40: the isolation-critical files). Each
one holds a guarantee a user of the KV manager relies on (a refcount, a block table, which block is copied, the
copy counters, the trace that ``kvlab trace explain`` reads, who owns a freed cached block under fair eviction,
the reserve's spares), and says which.
"""

from __future__ import annotations

import pytest
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


# -- admission: the blocks it takes, the spares it sets aside, the copies it makes ------------------------------
def test_an_admission_that_copies_its_partial_hit_still_reserves_its_whole_prompt() -> None:
    """A partial hit whose cached block goes on differently is copied at admission (into a block of its own), and
    every later block of the prompt is reserved too: 13 tokens, 4 blocks, the shared full block first."""
    trace = Trace()
    rig = Rig(cfg(), trace)
    rig.prefill("A", list(range(8)))
    rig.free("A")
    alloc = rig.m.allocate("B", [0, 1, 2, 3, 4, 5, 70, 71, 72, 73, 74, 75, 76], num_tokens=0)
    assert alloc.num_cached_tokens == 6
    assert alloc.copies == [(1, 2)]
    assert rig.m.block_table("B") == [0, 2, 3, 4]
    took = [(e.request, e.block, e.detail["purpose"]) for e in trace.select(op="alloc")]
    assert took == [("A", 0, "table"), ("A", 1, "table"), ("B", 2, "cow"), ("B", 3, "table"), ("B", 4, "table")]
    assert rig.m.stats.allocations == 2 + 3  # A's two blocks; B's copy target and its two reserved blocks
    assert rig.m.num_free_blocks() == 10 - 4


def test_an_admission_that_copies_its_partial_hit_sets_nothing_aside_for_the_block_it_leaves() -> None:
    """B's partial hit on A's frontier block goes on differently, so B copies it at admission: B never holds that
    block, so no spare is due for it, and a pool with one free block (the copy target) is enough."""
    trace = Trace()
    rig = Rig(cfg(num_blocks=2), trace)
    rig.prefill("A", [1, 2, 3])
    alloc = rig.m.allocate("B", [1, 2, 9, 9], num_tokens=0)
    assert alloc.ok and alloc.copies == [(0, 1)]
    assert rig.m.block_table("B") == [1] and rig.m.refcount(0) == 1
    assert rig.m.cow_reserve() == {}
    assert [e.detail["purpose"] for e in trace.select(op="alloc")] == ["table", "cow"]
    assert rig.m.stats.allocations == 2


def test_a_hit_on_a_block_another_request_still_writes_sets_its_copy_aside_even_when_the_hit_is_copied() -> None:
    """D writes into block 1 (it revived it through a partial hit). B's later hit reads block 1 whole and copies its
    own partial last block (it goes on differently): block 1's copy for D is still set aside at B's admission, so
    D's next write finds its target in a full pool."""
    rig = Rig(cfg(num_blocks=7))
    rig.prefill("A", list(range(12)))
    rig.free("A")
    assert rig.admit("D", [0, 1, 2, 3, 4, 5]) == 5
    alloc = rig.m.allocate("B", [*range(10), 99, 99], num_tokens=0)
    assert alloc.num_cached_tokens == 10 and alloc.copies == [(2, 3)]
    assert rig.m.block_table("B") == [0, 1, 3]
    [spare] = rig.m.cow_reserve()[1]
    assert rig.m.copies_due(1) == 1
    assert rig.prefill("F", list(range(100, 112))) == 0  # the pool is full now
    assert rig.m.num_free_blocks() == 0
    assert rig.feed("D", [5]).copies == [(1, spare)]
    assert rig.m.block_table("D") == [0, spare]
    clean(rig, "D", "F")


def test_a_second_hit_on_a_shared_partial_block_tops_the_reserve_up_to_the_copies_due() -> None:
    """A's frontier block is hit by B, then by C: three holders, all writing, two copies due. The reserve holds
    exactly two spares (B's admission set one aside, C's adds the one missing), and the pool lends no more."""
    rig = Rig(cfg())
    rig.prefill("A", A)
    shared = rig.m.block_table("A")[1]
    assert rig.admit("B", [*A, 60]) == 6
    assert len(rig.m.cow_reserve()[shared]) == 1
    assert rig.admit("C", [*A, 61]) == 6
    assert rig.m.refcount(shared) == 3 and rig.m.writers(shared) == 3
    assert rig.m.copies_due(shared) == 2
    assert len(rig.m.cow_reserve()[shared]) == 2
    assert rig.m.num_free_blocks() == 10 - 2 - 2
    check_invariants(rig.m)


def test_an_eager_copy_of_a_one_block_hit_copies_that_block() -> None:
    """cow_check="allocate": a prompt whose only hit is the partial block 0 another request writes copies block 0."""
    rig = Rig(cfg(cow_check="allocate"))
    rig.prefill("A", [1, 2])
    alloc = rig.m.allocate("B", [1, 2, 3], num_tokens=0)
    assert alloc.num_cached_tokens == 2 and alloc.copies == [(0, 1)]
    assert rig.m.block_table("A") == [0] and rig.m.block_table("B") == [1]
    assert rig.m.refcount(0) == 1 and rig.m.refcount(1) == 1
    assert rig.m.stats.cow_copies_eager == 1


def test_an_eager_copy_needs_one_free_block_the_spare_it_takes() -> None:
    """cow_check="allocate": B's eager copy of A's frontier block takes the one spare its admission sets aside;
    a pool with exactly that one block free admits B."""
    rig = Rig(cfg(num_blocks=4, cow_check="allocate"))
    rig.prefill("A", A)
    rig.prefill("F", [100, 101, 102, 103])
    assert rig.m.num_free_blocks() == 1
    alloc = rig.m.allocate("B", [*A, 60], num_tokens=0)
    assert alloc.ok and alloc.copies == [(1, 3)]
    assert rig.m.block_table("B") == [0, 3] and rig.m.num_free_blocks() == 0
    assert rig.m.cow_reserve() == {}


def test_an_eager_copy_counts_the_spares_already_set_aside_for_its_block() -> None:
    """cow_check="allocate": block 1 already has a spare (for D, which still writes into it; C reads it whole).
    B's partial hit on block 1 makes two copies due: B's admission adds one spare and its eager copy takes one,
    so one free block is enough, and D's spare stays."""
    rig = Rig(cfg(num_blocks=6, cow_check="allocate"))
    rig.prefill("A", list(range(8)))
    rig.free("A")
    assert rig.admit("D", [0, 1, 2, 3, 4, 5]) == 5
    assert rig.admit("C", [*range(8), 9]) == 8
    [spare] = rig.m.cow_reserve()[1]
    rig.prefill("F", [100, 101, 102, 103])
    assert rig.m.num_free_blocks() == 1
    alloc = rig.m.allocate("B", [0, 1, 2, 3, 4, 5], num_tokens=0)
    assert alloc.ok and alloc.num_cached_tokens == 5
    [(src, dst)] = alloc.copies
    assert src == 1 and rig.m.block_table("B") == [0, dst]
    assert rig.m.cow_reserve() == {1: [spare]} and rig.m.num_free_blocks() == 0
    assert rig.m.stats.cow_copies_eager == 1


def test_every_hit_is_traced_with_its_tokens_and_whether_it_was_verified() -> None:
    """``kvlab trace explain`` tells a verified shared read from contamination by the hit events' detail."""
    for verify in (True, False):
        trace = Trace()
        rig = Rig(cfg(verify_tokens=verify, unsafe=not verify), trace)
        rig.prefill("A", A)
        assert rig.admit("B", [*A, 60]) == 6
        hits = [(e.request, e.block, e.refcount, e.detail) for e in trace.select(op="hit")]
        assert hits == [
            ("B", 0, 2, {"tokens": 4, "partial": False, "verified": verify}),
            ("B", 1, 2, {"tokens": 2, "partial": True, "verified": verify}),
        ]


def test_a_partial_hit_copied_at_admission_is_traced_and_its_cached_block_owned_by_the_copier() -> None:
    """The copy made at admission (the hit goes on differently) is traced as B's: the target's ``alloc`` (purpose
    "cow"), the ``cow`` event (source, slots kept) and the ``free`` of the cached source, which stays findable and,
    under fair eviction, counts as B's tenant's."""
    trace = Trace()
    rig = Rig(cfg(eviction="fair"), trace)
    rig.prefill("A", list(range(8)), tenant="tenant-a")
    rig.free("A")
    assert rig.m.pool.owners() == {"tenant-a": 2}
    alloc = rig.m.allocate("B", [0, 1, 2, 3, 4, 5, 70, 71], num_tokens=0, tenant="tenant-b")
    assert alloc.copies == [(1, 2)] and rig.m.block_table("B") == [0, 2]
    b = [(e.op, e.request, e.block, e.refcount, e.detail) for e in trace.events if e.request == "B"]
    assert b == [
        ("hit", "B", 0, 1, {"tokens": 4, "partial": False, "verified": True}),
        ("hit", "B", 1, 1, {"tokens": 2, "partial": True, "verified": True}),
        ("alloc", "B", 2, 1, {"purpose": "cow"}),
        ("cow", "B", 2, 1, {"src": 1, "slots": 2}),
        ("free", "B", 1, 0, {"reason": "cow"}),
    ]
    assert rig.m.is_cached(1) and rig.m.pool.owners() == {"tenant-b": 1}


# -- append_slots ---------------------------------------------------------------------------------------------------
def test_every_write_is_traced_with_its_request_block_holders_and_slots() -> None:
    """``kvlab trace explain`` rebuilds each slot's writer from the ``write`` events: B's write after its copy lands
    in the copy (2 slots kept), its decode past the block takes a new block in B's name and writes its slot 0."""
    trace = Trace()
    rig = Rig(cfg(), trace)
    rig.prefill("A", A)
    assert rig.admit("B", [*A, 60]) == 6
    [spare] = rig.m.cow_reserve()[1]
    alloc = rig.feed("B", [60, 61, 62])
    [new] = [b for b in rig.m.block_table("B") if b not in (0, spare)]
    assert rig.m.block_table("B") == [0, spare, new]
    assert alloc.copies == [(1, spare)]
    assert alloc.slots == [spare * BS + 2, spare * BS + 3, new * BS]
    writes = [(e.request, e.block, e.refcount, e.detail) for e in trace.select(op="write")]
    assert writes == [
        ("A", 0, 1, {"slots": [0, 1, 2, 3]}),
        ("A", 1, 1, {"slots": [4, 5]}),
        ("B", spare, 1, {"slots": [spare * BS + 2, spare * BS + 3]}),
        ("B", new, 1, {"slots": [new * BS]}),
    ]
    [took] = trace.select(op="alloc", block=new)
    assert (took.request, took.refcount, took.detail) == ("B", 1, {"purpose": "table"})
    clean(rig, "A", "B")


def test_a_write_into_a_block_others_read_is_traced_with_their_count() -> None:
    """copy_on_write=False (unsafe): B writes into the block A holds too; the write event's refcount (2) is how the
    trace shows the write landed where another request reads."""
    trace = Trace()
    rig = Rig(cfg(copy_on_write=False, unsafe=True), trace)
    rig.prefill("A", A)
    assert rig.admit("B", [*A, 60]) == 6
    assert rig.feed("B", [60]).slots == [1 * BS + 2]
    last = trace.select(op="write")[-1]
    assert (last.request, last.block, last.refcount, last.detail) == ("B", 1, 2, {"slots": [6]})


def test_tokens_that_differ_from_the_prompt_are_refused_with_their_positions() -> None:
    m = KVCacheManager(cfg())
    m.allocate("C", [1, 2, 3, 4, 5], num_tokens=0)
    assert m.append_slots("C", [1, 2]).slots == [0, 1]
    with pytest.raises(ValueError) as refused:
        m.append_slots("C", [3, 9, 9])
    assert str(refused.value) == "request 'C': tokens for positions 2..4 differ from its prompt"
    assert m.num_computed_tokens("C") == 2


def test_a_chunk_needs_copy_targets_only_for_the_shared_blocks_it_writes_each_counted_with_its_own_spares() -> None:
    """A fork mid-prefill in a nearly full pool: C shares P's partial block 0 (one spare set aside, the last free
    block) and its reserved blocks 1 and 2 (none). C's chunk into blocks 0 and 1 needs one block beyond block 0's
    spare: refused cleanly while none is free, then written once one is; block 2, which it does not write, counts
    for nothing."""
    rig = Rig(cfg(num_blocks=6))
    prompt = list(range(10))
    rig.admit("P", prompt)
    rig.feed("P", prompt[:3])  # block 0 holds 3 tokens, blocks 1 and 2 are reserved
    rig.prefill("Q1", [100, 101, 102, 103])
    rig.prefill("Q2", [200, 201])
    assert rig.m.num_free_blocks() == 1
    rig.fork("P", "C")
    [spare] = rig.m.cow_reserve()[0]
    assert rig.m.cow_reserve() == {0: [spare]} and rig.m.num_free_blocks() == 0
    before = rig.snapshot()
    refused = rig.m.append_slots("C", prompt[3:8])
    assert refused.failure is AllocFailure.COW_SPARES
    assert rig.snapshot() == before
    rig.free("Q2")
    assert rig.m.num_free_blocks() == 1
    alloc = rig.feed("C", prompt[3:8])
    assert alloc.copies == [(0, spare)]  # block 1 is empty: swapped for a fresh block, nothing to copy
    table = rig.m.block_table("C")
    assert table[0] == spare and table[1] not in rig.m.block_table("P") and table[2] == 2
    assert alloc.slots == [spare * BS + 3, *range(table[1] * BS, table[1] * BS + 4)]
    clean(rig, "C")


def test_a_chunk_into_several_shared_blocks_without_spares_needs_a_block_for_each() -> None:
    """A fork mid-prefill in a full pool sets nothing aside. C's chunk into blocks 0 (copied, 3 slots kept) and 1
    (reserved, swapped for a fresh block) needs two free blocks: refused with one, written with two."""
    rig = Rig(cfg(num_blocks=6))
    prompt = list(range(10))
    rig.admit("P", prompt)
    rig.feed("P", prompt[:3])
    rig.prefill("Q1", [100, 101, 102, 103])
    rig.prefill("Q2", [200, 201, 202, 203])
    rig.prefill("Q3", [300])
    rig.fork("P", "C")
    assert rig.m.cow_reserve() == {} and rig.m.num_free_blocks() == 0
    rig.free("Q1")
    before = rig.snapshot()
    assert rig.m.append_slots("C", prompt[3:8]).failure is AllocFailure.COW_SPARES
    assert rig.snapshot() == before
    rig.free("Q2")
    alloc = rig.feed("C", prompt[3:8])
    assert alloc.copies == [(0, rig.m.block_table("C")[0])]
    assert set(rig.m.block_table("C")[:2]).isdisjoint(rig.m.block_table("P"))
    clean(rig, "P", "C")


def test_a_write_that_would_overwrite_a_cached_prefix_is_refused_cleanly_in_a_full_pool() -> None:
    """B's decode would overwrite the cached continuation of its block 1: it needs a block to copy into. With none
    free the write is refused (COW_SPARES) and nothing changes; once one is free, the copy is made."""
    rig = Rig(cfg(num_blocks=4))
    _clobbered(rig, None)
    rig.prefill("F1", [100, 101, 102, 103])
    rig.prefill("F2", [200, 201, 202, 203])  # the pool is full
    before = rig.snapshot()
    assert rig.m.append_slots("B", [99]).failure is AllocFailure.COW_SPARES
    assert rig.snapshot() == before
    rig.free("F1")  # one block free: the one copy it needs
    alloc = rig.feed("B", [99])
    assert alloc.copies == [(1, rig.m.block_table("B")[1])] and rig.m.block_table("B")[1] != 1
    clean(rig, "B")


def test_an_eager_copy_its_request_wrote_into_is_not_counted_as_unneeded() -> None:
    """cow_check="allocate": C1 and C2 each copy P's frontier block at the fork. C1 writes into its copy (and on into
    a new block), C2 never writes: freeing both counts one unneeded eager copy, C2's."""
    rig = Rig(cfg(cow_check="allocate"))
    rig.prefill("P", A)
    rig.fork("P", "C1")
    rig.fork("P", "C2")
    assert rig.m.stats.cow_copies_eager == 2
    assert rig.feed("C1", [8, 9, 10]).copies == []  # into its own copy, then a new block
    rig.free("C1")
    assert rig.m.stats.cow_copies_unneeded == 0
    rig.free("C2")
    assert rig.m.stats.cow_copies_unneeded == 1
    clean(rig, "P")
