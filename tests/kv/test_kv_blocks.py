from __future__ import annotations

import pytest

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
