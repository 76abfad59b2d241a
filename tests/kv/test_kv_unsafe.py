"""Each unsafe knob really leaks another request's K/V; the safe setting next to it does not.

The leak is shown at the storage level (the synthetic K/V read back names its writer) and by the sanitizer.
"""

from __future__ import annotations

import pytest
from kv_rig import Rig, cfg, clean

from kvlab.config import CacheConfig, ConfigError
from kvlab.kv import check_invariants


def leaked(rig: Rig, reader: str, writer: str) -> bool:
    """True when ``reader`` reads K/V that ``writer`` wrote and that is not the reader's own."""
    violations = rig.check(reader)
    foreign = rig.foreign(reader)
    assert bool(violations) == bool(foreign), (violations, foreign)  # sanitizer and storage agree
    assert {v.writer for v in violations} <= {writer} and set(foreign.values()) <= {writer}
    return bool(violations)


@pytest.mark.parametrize("kw", [{"copy_on_write": False}, {"reference_counting": False}, {"hash_algo": "weak"}])
def test_unsafe_knobs_are_refused_without_unsafe(kw):
    with pytest.raises(ConfigError, match="unsafe"):
        cfg(**kw)


@pytest.mark.parametrize("cow", [True, False])
def test_no_copy_on_write_lets_a_write_land_in_a_shared_block(cow):
    rig = Rig(cfg(copy_on_write=cow, unsafe=not cow))
    a = [10, 11, 12, 13, 14, 15]
    rig.prefill("A", a)
    assert rig.admit("B", [*a, 60]) == 6
    rig.feed("B", [60])  # B's token at position 6
    rig.feed("A", [16])  # A's token at position 6: the same slot unless B was given a copy
    assert leaked(rig, "B", "A") is not cow
    if not cow:
        [v] = rig.check("B")
        assert (v.position, v.expected_token, v.found_token, v.writer) == (6, 60, 16, "A")
        assert "written by request A" in v.explain()
        # The overwritten block no longer claims to hold any prefix.
        shared = rig.m.block_table("A")[1]
        assert rig.m.block_table("B")[1] == shared and rig.m.refcount(shared) == 2
        assert rig.m.index.content(shared) is None
    check_invariants(rig.m)


def test_no_copy_on_write_breaks_forks_too():
    rig = Rig(cfg(copy_on_write=False, unsafe=True))
    rig.prefill("P", [1, 2, 3, 4, 5])
    rig.fork("P", "C")
    rig.feed("P", [6])
    rig.feed("C", [7])
    assert leaked(rig, "P", "C")


@pytest.mark.parametrize("refcounting", [True, False])
def test_no_reference_counting_frees_blocks_another_request_still_reads(refcounting):
    rig = Rig(cfg(reference_counting=refcounting, unsafe=not refcounting))
    a = list(range(8))
    rig.prefill("A", a)
    assert rig.prefill("B", [*a, 8, 9]) == 8  # shares A's two full blocks
    rig.free("A")  # A finishes first
    # C needs 8 blocks. With refcounts only 7 are free and C waits; without, A's free handed B's blocks
    # back to the pool and C is given one of them.
    admitted = rig.prefill("C", list(range(100, 132))) is not None
    assert admitted is not refcounting
    assert leaked(rig, "B", "C") is not refcounting
    if not refcounting:
        # A's freed blocks lost their cached identity and went to the front of the queue: C took both.
        assert {v.position for v in rig.check("B")} == set(range(8))
        rig.free("C")
    # Whatever the tables say, the pool itself stays consistent and every block comes back.
    rig.free("B")
    check_invariants(rig.m)
    assert rig.m.num_free_blocks() == 10 and rig.m.usage() == 0.0


def test_no_reference_counting_tolerates_double_frees_and_revival():
    rig = Rig(cfg(reference_counting=False, unsafe=True))
    rig.prefill("A", list(range(6)))
    rig.fork("A", "B")
    rig.free("A")  # releases both blocks though B holds them
    rig.fork("B", "C")  # revives them from the free queue
    rig.free("B")
    rig.free("C")  # already free: tolerated
    check_invariants(rig.m)
    assert rig.m.num_free_blocks() == 10


@pytest.mark.parametrize("verify", [True, False])
def test_weak_hash_without_verification_shares_a_near_miss_prefix(verify):
    rig = Rig(cfg(hash_algo="weak", verify_tokens=verify, unsafe=True))
    rig.prefill("A", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    cached = rig.prefill("B", [2, 1, 3, 4, 5, 6, 7, 8, 9])  # two tokens swapped: same weak keys
    assert cached == (0 if verify else 8)
    assert leaked(rig, "B", "A") is not verify
    if not verify:
        found = {v.position: v for v in rig.check("B")}
        assert (found[0].expected_token, found[0].found_token) == (2, 1)
        # Positions 2..7 hold the right tokens computed after the wrong prefix: still foreign.
        assert found[5].found_token == found[5].expected_token == 6
        assert "different prefix" in found[5].explain()


def test_strong_hash_without_verification_finds_no_collision():
    rig = Rig(cfg(verify_tokens=False, unsafe=True))
    rig.prefill("A", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert rig.prefill("B", [2, 1, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert not leaked(rig, "B", "A")


@pytest.mark.parametrize("verify", [True, False])
def test_verification_checks_the_parent_not_only_the_tokens(verify):
    """A block with the right tokens under a colliding parent holds K/V computed after another prefix."""
    rig = Rig(CacheConfig(block_size=2, num_blocks=12, hash_algo="weak", verify_tokens=verify, unsafe=True))
    rig.prefill("A", [1, 2, 3, 4])
    # C's block 0 [2, 1] collides with A's [1, 2]. Verified, the hit is rejected and C's own block 1
    # [5, 6] gets the key "A's block 0, then [5, 6]" (the parent keys collide). Unverified, C even
    # shares A's block 0; either way C's K/V at positions 2, 3 were computed after [2, 1].
    assert rig.prefill("C", [2, 1, 5, 6]) == (0 if verify else 2)
    cached = rig.prefill("D", [1, 2, 5, 6, 9])
    if verify:
        assert cached == 2  # A's block 0 only: C's [5, 6] follows [2, 1], not [1, 2]
        assert not leaked(rig, "D", "C")
    else:
        assert cached == 4
        assert leaked(rig, "D", "C")


def test_a_refused_allocate_without_reference_counts_leaves_other_requests_blocks_alone() -> None:
    """The unsafe mode changes one rule, free() letting go of blocks other tables hold; a refused allocate is not
    a free. B shares A's blocks, its first chunk finds no block to copy into (no reserve without reference
    counts), and the admission is undone one reference at a time: A's blocks stay held and findable, nothing is
    counted as freed (before, the undo force-released A's blocks into the free queue)."""
    rig = Rig(cfg(num_blocks=6, reference_counting=False, unsafe=True))
    prompt = [10, 11, 12, 13, 14, 15]
    rig.prefill("A", prompt)
    rig.prefill("C", list(range(100, 116)))  # the pool is full
    before = [rig.m.refcount(b) for b in range(rig.m.num_blocks)], rig.m.pool.free_order()
    assert rig.m.allocate("B", [*prompt, 60]).failure is not None
    assert ([rig.m.refcount(b) for b in range(rig.m.num_blocks)], rig.m.pool.free_order()) == before
    assert rig.m.lookup([*prompt, 60]) == len(prompt)
    assert rig.m.stats.frees == 0 and rig.m.request_ids() == ["A", "C"]


def test_a_write_in_place_over_other_tokens_ends_the_blocks_identity() -> None:
    """Without copy-on-write a write lands in place even where a cached block holds other tokens at that slot
    (``_clobbers`` copies first only with copy-on-write). The index must then drop what the block held: a later
    lookup of the old tokens finds only the part that still agrees, and a reader of it reads its own K/V (the
    mutation run's ``record_write`` 4, which compared no token before keeping the block's identity)."""
    rig = Rig(cfg(copy_on_write=False, unsafe=True))
    a = [10, 11, 12, 13, 20, 21, 22]  # a full block, then three tokens of a partial one
    rig.prefill("A", a)
    rig.free("A")  # its blocks stay cached: the partial one holds [20, 21, 22]
    assert rig.admit("B", [10, 11, 12, 13, 20, 21, 99]) == 6  # hits [20, 21] of the partial block
    rig.feed("B", [99])  # in place over A's 22: the same slot
    assert rig.m.lookup([*a, 5]) == 6, "the index still offers A's 22, whose slot now holds B's 99"
    rig.free("B")
    assert rig.admit("C", [*a, 5]) == 6
    rig.feed("C", [22, 5])
    clean(rig, "C")


@pytest.mark.parametrize("verify", [True, False])
def test_unverified_lookups_group_partial_blocks_by_the_key_they_trust(verify):
    """A's [1, 2, 3, 4] and B's [2, 1, 3, 4] are computed in the same step, so both become findable, under one weak
    key (A's first, B's as a copy). C wants [2, 1, 3, 4] then [5, 6]: B's exact prefix. Verified, C finds B's block 0
    through the trie and B's partial [5, 6] under it: 6 tokens, all B's own. Unverified, C takes the key's block
    (A's, the wrong tokens) and looks for its partial block in the group of that key, where B's [5, 6] also is:
    still 6 tokens. Grouping by the parent's content instead would find nothing under A's block (4): the unsafe mode
    would then hide the partial-block half of the collision it exists to show."""
    from kvlab.kv import KVCacheManager

    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=32, hash_algo="weak", verify_tokens=verify, unsafe=True))
    with kv.step():
        kv.allocate("A", [1, 2, 3, 4, 7, 8])
        kv.allocate("B", [2, 1, 3, 4, 5, 6])
    assert kv.lookup([2, 1, 3, 4, 5, 6, 9]) == 6
    c = kv.allocate("C", [2, 1, 3, 4, 5, 6, 9])
    assert c.num_cached_tokens == 6
    assert kv.block_table("C")[0] == kv.block_table("B" if verify else "A")[0]
