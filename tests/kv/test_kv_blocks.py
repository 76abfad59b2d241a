from __future__ import annotations

import hashlib
import struct
from array import array

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.kv.blocks import BlockPool
from kvlab.kv.hashing import hash_block, salt_extra


def test_free_queue_order_and_revival():
    pool = BlockPool(5)
    assert [pool.take() for _ in range(3)] == [0, 1, 2]
    assert pool.usage() == pytest.approx(3 / 5)
    for b in (2, 1):
        assert pool.decref(b) == 0
        pool.release(b, cached=True)  # cached: to the back
    assert pool.decref(0) == 0
    pool.release(0, cached=False)  # nothing findable: to the front
    assert pool.free_order() == [0, 3, 4, 2, 1]
    assert pool.incref(4) == 1  # a prefix hit revives a block from the middle
    assert pool.free_order() == [0, 3, 2, 1]
    assert pool.incref(4) == 2
    assert pool.take() == 0
    assert pool.num_free() + pool.num_used() == 5


def test_pool_refuses_inconsistent_transitions():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.decref(0)
    b = pool.take()
    with pytest.raises(RuntimeError):
        pool.release(b, cached=False)
    pool.take()
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.take()
    assert pool.drop_all(b) is True
    pool.release(b, cached=False)
    assert pool.drop_all(b) is False  # a second unsafe free of the same block is a no-op


@pytest.mark.parametrize("algo", ["sha256", "xxh64", "weak"])
def test_hash_chain_is_deterministic_and_depends_on_parent_and_extra(algo):
    h0 = hash_block(None, [1, 2, 3], (), algo)
    assert h0 == hash_block(None, [1, 2, 3], (), algo)
    assert hash_block(h0, [4, 5, 6], (), algo) != hash_block(h0 + 1, [4, 5, 6], (), algo)
    assert hash_block(None, [1, 2, 3], salt_extra("s"), algo) != h0


def test_strong_hashes_see_order_and_kind_the_weak_one_does_not():
    for algo in ("sha256", "xxh64"):
        assert hash_block(None, [1, 2, 3], (), algo) != hash_block(None, [2, 1, 3], (), algo)
        assert hash_block(None, [7], (("salt", "x"),), algo) != hash_block(None, [7], (("lora", "x"),), algo)
        assert hash_block(None, [7], (), algo) != hash_block(0, [7], (), algo)  # root is not parent 0
    assert hash_block(None, [1, 2, 3], (), "weak") == hash_block(None, [2, 1, 3], (), "weak")
    assert hash_block(None, [1, 2, 3], (), "weak") < 1 << 16


def test_extra_keys_must_be_tagged():
    with pytest.raises(TypeError, match="salt"):
        hash_block(None, [1], ("tenant-1",))  # a bare string could be confused with another kind of key
    with pytest.raises(ValueError):
        hash_block(None, [1], (), "md5")
    assert salt_extra(None) == () and salt_extra("x") == (("salt", "x"),)


def _drive(pool: BlockPool, ops: list[tuple[int, int, int]]) -> list[int]:
    """Apply ops (kind, pick, owner) to ``pool``: take, release (cached or not) a held block, revive a free one.
    Returns the blocks handed out, in order."""
    held: list[int] = []
    taken = []
    for kind, pick, owner in ops:
        if kind == 0 and pool.num_free():
            taken.append(pool.take())
            held.append(taken[-1])
        elif kind in (1, 2) and held:
            b = held.pop(pick % len(held))
            pool.decref(b)
            pool.release(b, cached=kind == 1, owner=f"t{owner}")
        elif kind == 3 and pool.num_free():
            order = pool.free_order()
            b = order[pick % len(order)]
            pool.incref(b)
            held.append(b)
        assert sorted(pool.free_order() + held) == list(range(pool.num_blocks))
    return taken


OPS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 99), st.integers(0, 2)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_fair_eviction_with_one_owner_is_the_lru_order(ops):
    """With one tenant, fair eviction hands out the same blocks as LRU, call for call (it costs nothing)."""
    one = [(kind, pick, 0) for kind, pick, _ in ops]
    lru, fair = BlockPool(8), BlockPool(8, fair=True)
    assert _drive(lru, one) == _drive(fair, one)
    assert lru.free_order() == fair.free_order()


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_fair_eviction_takes_from_the_owner_holding_the_most(ops):
    """Every take that evicts a cached block takes the least recently freed block of an owner holding the most
    cached free blocks; free_order() predicts the takes."""
    pool = BlockPool(8, fair=True)
    _drive(pool, ops)
    while pool.num_free():
        predicted = pool.free_order()
        owners = pool.owners()
        block = pool.take()
        assert block == predicted[0]
        if owners and sum(owners.values()) == len(predicted):  # nothing plain left: an eviction
            after = pool.owners()
            [loser] = [o for o, n in owners.items() if after.get(o, 0) == n - 1]
            assert owners[loser] == max(owners.values())


def test_a_flood_evicts_the_flooders_own_blocks_first():
    pool = BlockPool(10, fair=True)
    blocks = [pool.take() for _ in range(10)]
    for b in blocks[:3]:  # the victim's cached document
        pool.decref(b)
        pool.release(b, cached=True, owner="victim")
    for b in blocks[3:]:  # the flooder's stale prompts, freed after the victim's
        pool.decref(b)
        pool.release(b, cached=True, owner="flood")
    assert [pool.take() for _ in range(4)] == blocks[3:7]  # the flooder pays, oldest first
    assert pool.owners() == {"victim": 3, "flood": 3}
    assert pool.take() == blocks[0]  # a tie: the oldest block of the two owners' goes
    lru = BlockPool(10)
    for b in [lru.take() for _ in range(10)]:
        lru.decref(b)
        lru.release(b, cached=True)
    assert [lru.take() for _ in range(4)] == blocks[:4]  # plain LRU: the victim's document goes first


def test_the_default_hash_is_sha256_and_an_unknown_one_is_named():
    assert hash_block(None, [1, 2, 3]) == hash_block(None, [1, 2, 3], (), "sha256")
    with pytest.raises(ValueError, match="unknown hash algo 'md5'; expected sha256, xxh64 or weak"):
        hash_block(None, [1], (), "md5")


@settings(max_examples=100, deadline=None)
@given(
    parent=st.none() | st.integers(0, 2**70),
    tokens=st.lists(st.integers(0, 50_000), max_size=8),
    salt=st.none() | st.text(max_size=4),
)
def test_the_weak_hash_is_a_16_bit_order_blind_sum(parent, tokens, salt):
    """The experiment's broken hash, exactly as documented: the sum of the parent key, the tokens and the extra
    keys' bytes, cut to 16 bits, so that a swap of two tokens collides."""
    extra = salt_extra(salt)
    key = hash_block(parent, tokens, extra, "weak")
    assert key == ((parent or 0) + sum(tokens) + sum(repr(extra).encode())) & 0xFFFF
    assert key == hash_block(parent, tokens[::-1], extra, "weak")


def test_extra_keys_and_keyings_are_validated():
    from kvlab.kv.hashing import Keying

    for bad in [(("salt",),), (("salt", "a", "b"),), ((1, "a"),), ("salt",)]:
        with pytest.raises(TypeError, match="extra keys must be \\(kind, value\\) tuples"):
            hash_block(None, [1], bad)  # type: ignore[arg-type]
    for n in (-1, True, 1.5):
        with pytest.raises(ValueError, match=f"Keying.public_blocks must be an int >= 0, got {n!r}"):
            Keying("s", n)  # type: ignore[arg-type]
    assert Keying("s", 0).public_blocks == 0 and Keying("s", 3).public_blocks == 3


def test_the_pool_names_each_misuse():
    for n in (0, -3):
        with pytest.raises(ValueError, match=f"^num_blocks must be >= 1, got {n}$"):
            BlockPool(n)
    assert BlockPool(1).num_free() == 1  # one block is a pool
    assert BlockPool(4).fair is False  # LRU unless asked (the library's default)
    pool = BlockPool(1)
    with pytest.raises(RuntimeError, match="^block 0 freed more often than it was held$"):
        pool.decref(0)
    b = pool.take()
    with pytest.raises(RuntimeError, match="^block pool exhausted; callers must check num_free\\(\\) first$"):
        pool.take()
    with pytest.raises(RuntimeError, match="^block 0 released with refcount 1$"):
        pool.release(b, cached=True)


def test_a_block_key_is_the_hash_of_its_documented_bytes() -> None:
    """The key's input, byte for byte: a tag (0: first block; 1: then the parent's key in 32 big-endian bytes), the
    token count (4 bytes, little-endian), the tokens (8-byte signed, native order), the extra keys' repr. Pinned so
    that a change of encoding, even an injective one, is a decision and not an accident (the mutation run's
    ``_encode`` survivors)."""
    tokens, extra = [7, 300, 2**40], (("salt", "t"),)
    first = b"\x00" + struct.pack("<I", 3) + array("q", tokens).tobytes() + repr(extra).encode()
    key = hash_block(None, tokens, extra)
    assert key == int.from_bytes(hashlib.sha256(first).digest(), "big")
    second = b"\x01" + key.to_bytes(32, "big") + struct.pack("<I", 1) + array("q", [5]).tobytes() + b"()"
    assert hash_block(key, [5]) == int.from_bytes(hashlib.sha256(second).digest(), "big")
    assert hash_block(None, tokens, extra, "xxh64") == xxhash.xxh64_intdigest(first)
