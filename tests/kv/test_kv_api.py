"""Manager API edges, the trace, and the invariant checker's own ability to fail."""

from __future__ import annotations

import pytest
from kv_rig import Rig, cfg

from kvlab.instrument.trace import Trace, TraceEvent
from kvlab.kv import Allocation, AllocFailure, InvariantError, KVCacheManager, check_invariants


def test_api_errors():
    m = KVCacheManager(cfg())
    with pytest.raises(ValueError, match="empty"):
        m.allocate("A", [])
    assert m.allocate("A", [1, 2, 3], num_tokens=0) == Allocation(num_cached_tokens=0)
    with pytest.raises(ValueError, match="already"):
        m.allocate("A", [1])
    with pytest.raises(ValueError, match="prompt"):
        m.append_slots("A", [1, 9])
    assert m.append_slots("A", []) == Allocation([], [])
    with pytest.raises(KeyError):
        m.free("nobody")
    with pytest.raises(KeyError):
        m.append_slots("nobody", [1])
    with pytest.raises(KeyError):
        m.fork("nobody", "C")
    m.append_slots("A", [1, 2])
    m.fork("A", "C")
    with pytest.raises(ValueError, match="already"):
        m.fork("A", "C")
    assert m.num_computed_tokens("C") == 2
    assert m.append_slots("C", [3, 4, 5]).ok  # the child continues the parent's prompt, then decodes


def test_prompt_chunks_use_reserved_blocks_and_decode_takes_new_ones_at_boundaries():
    m = KVCacheManager(cfg())
    assert m.allocate("A", list(range(6)), num_tokens=0).num_cached_tokens == 0
    assert m.block_table("A") == [0, 1]  # the whole prompt is reserved up front
    assert m.num_free_blocks() == 8 and m.usage() == pytest.approx(0.2)
    assert m.append_slots("A", [0, 1, 2]).slots == [0, 1, 2]
    assert m.append_slots("A", [3, 4, 5]).slots == [3, 4, 5]
    assert m.append_slots("A", [6, 7]).slots == [6, 7]  # decode fills the partial block
    assert m.block_table("A") == [0, 1]
    assert m.append_slots("A", [8]).slots == [8]  # the boundary: a new block from the pool
    assert m.block_table("A") == [0, 1, 2]
    assert m.num_computed_tokens("A") == 9
    m.free("A")
    assert m.num_free_blocks() == 10 and m.usage() == 0.0


def test_failed_append_changes_nothing():
    rig = Rig(cfg(num_blocks=2))
    rig.prefill("A", [1, 2, 3, 4, 5, 6, 7, 8])
    before = rig.snapshot()
    assert rig.m.append_slots("A", [9]).failure is AllocFailure.TABLE_BLOCKS
    assert rig.snapshot() == before
    assert rig.m.num_computed_tokens("A") == 8


def test_sharing_off_never_hits_and_keeps_no_index():
    rig = Rig(cfg(share_prefix=False))
    rig.prefill("A", list(range(9)))
    assert rig.prefill("B", list(range(9))) == 0
    assert rig.m.index is None
    assert set(rig.m.block_table("A")).isdisjoint(rig.m.block_table("B"))
    assert rig.m.stats.prefix_cache_queries == 0


def test_stats_count_tokens_blocks_and_copies():
    rig = Rig(cfg())
    rig.prefill("A", list(range(10)))
    rig.prefill("B", [*range(9), 50])
    s = rig.m.stats
    assert (s.requests, s.prefix_cache_queries, s.prefix_cache_hits) == (2, 20, 9)
    assert s.prefix_hit_rate == pytest.approx(9 / 20)
    assert (s.hit_blocks, s.cow_copies, s.peak_refcount) == (3, 1, 2)
    assert s.allocations == 3 + 1  # A's three blocks, B's copy target
    rig.free("A")
    rig.free("B")
    assert s.frees == 2


def test_trace_records_the_life_of_a_shared_block(tmp_path):
    path = tmp_path / "trace.jsonl"
    with Trace(path) as trace:
        rig = Rig(cfg(num_blocks=4), trace)
        trace.step = 1
        rig.prefill("A", [1, 2, 3, 4, 5, 6])
        trace.step = 2
        rig.prefill("B", [1, 2, 3, 4, 5, 6, 7])
        trace.step = 3
        rig.free("A")
        rig.free("B")
        rig.m.reset_prefix_cache()
        rig.prefill("C", [9])
        with pytest.raises(ValueError):
            trace.emit("explode")
    events = Trace.read_jsonl(path)
    assert events == trace.events
    ops = [e.op for e in events]
    assert set(ops) == {"alloc", "hit", "write", "cow", "free", "reset"}
    assert [(e.step, e.op, e.request, e.block, e.refcount) for e in events if e.op == "hit"] == [
        (2, "hit", "B", 0, 2),
        (2, "hit", "B", 1, 2),
    ]
    [cow] = trace.select(op="cow")
    # The copy target is the block set aside when B was admitted.
    assert [e.block for e in trace.select(op="alloc", request="B")] == [2]
    assert cow == TraceEvent(2, "cow", "B", 2, 1, {"src": 1, "slots": 2})
    frees = [(e.block, e.refcount, e.detail["reason"]) for e in trace.select(op="free", request="B")]
    assert frees == [(1, 1, "cow"), (2, 0, "free"), (0, 0, "free")]  # B's own blocks go tail first
    evicting = Trace()
    rig = Rig(cfg(num_blocks=2), evicting)
    rig.prefill("A", [1, 2, 3, 4, 5])
    rig.free("A")
    rig.prefill("B", [7, 7, 7, 7, 7, 7, 7, 7])
    assert [e.block for e in evicting.select(op="evict")] == [1, 0]


def test_check_invariants_catches_corruption():
    def fresh() -> Rig:
        rig = Rig(cfg())
        rig.prefill("A", list(range(6)))
        rig.prefill("B", list(range(7)))
        check_invariants(rig.m)
        return rig

    rig = fresh()
    rig.m.pool._refcount[0] += 1
    with pytest.raises(InvariantError, match="block 0 has refcount 3"):
        check_invariants(rig.m)

    rig = fresh()
    rig.m.tables["B"].blocks[0] = 7
    with pytest.raises(InvariantError, match="refcount"):
        check_invariants(rig.m)

    rig = fresh()
    key = next(iter(rig.m.index._by_hash))
    rig.m.index._content[0].tokens[0] = 99
    with pytest.raises(InvariantError, match=f"key {key:#x}"):
        check_invariants(rig.m)

    rig = fresh()
    rig.m.index._roots.clear()
    with pytest.raises(InvariantError, match="trie"):
        check_invariants(rig.m)

    rig = fresh()
    rig.m.pool._free[0] = None
    with pytest.raises(InvariantError, match="free"):
        check_invariants(rig.m)
