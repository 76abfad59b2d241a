"""Public prefixes: blocks keyed without salt are shared across salts; a tenant's private blocks never are.

A request's first ``public_prefix_tokens // block_size`` full blocks are public (no salt in their extra keys);
its salt enters at the next block and reaches every later one through the chain.
"""

from __future__ import annotations

import dataclasses

import pytest
from kv_rig import BS, Rig, cfg, clean

from kvlab.instrument.sanitizer import KVSanitizer, Namespace, prefix_digests
from kvlab.kv import InvariantError, Keying, check_invariants
from kvlab.kv.hashing import hash_block, salt_extra

SYSTEM = list(range(100, 108))  # two full blocks of 4: the public system prompt
SECRET_A = [1, 2, 3, 4, 5, 6, 7, 8]  # two more full blocks: tenant a's private text
SECRET_B = [9, 10, 11]


def chain(tokens: list[int], extras: list[tuple], algo: str = "sha256") -> list[int]:
    """The chain keys of the full blocks of ``tokens``, block i hashed with ``extras[i]``."""
    keys: list[int] = []
    for i in range(len(tokens) // BS):
        keys.append(hash_block(keys[-1] if keys else None, tokens[i * BS : (i + 1) * BS], extras[i], algo))
    return keys


# -- keying ---------------------------------------------------------------------------------------------
def test_keying_puts_the_salt_at_the_first_private_block():
    k = Keying.of("a", 10, BS)  # floor: 10 tokens make two full public blocks; block 2 is private
    assert k == Keying("a", 2)
    assert [k.extra(i) for i in range(4)] == [(), (), salt_extra("a"), ()]
    assert [k.namespace(i) for i in range(4)] == [None, None, "a", "a"]
    assert k.public_tokens(BS) == 8
    assert Keying("a").extra(0) == salt_extra("a")  # P = 0: the salt in block 0, as before public prefixes
    # Without a salt every block is public, whatever was declared: the keys are the same either way.
    assert Keying(None, 5) == Keying(None) and Keying(None).public_tokens(BS) is None
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="public"):
            Keying.of("a", bad, BS)  # type: ignore[arg-type]


def test_keyings_agree_exactly_on_the_blocks_both_key_alike():
    a2, a1, b2, free = Keying("a", 2), Keying("a", 1), Keying("b", 2), Keying(None)
    assert a2.agrees(a2, 99) and free.agrees(free, 99)
    assert a2.agrees(b2, 2) and not a2.agrees(b2, 3)  # public for both, then each its own salt
    assert a2.agrees(a1, 1) and not a2.agrees(a1, 2)  # same salt, another boundary: block 1 differs
    assert free.agrees(a2, 2) and not free.agrees(a2, 3)
    assert not Keying("a").agrees(Keying("b"), 1) and Keying("a").agrees(Keying("b"), 0)


@pytest.mark.parametrize("algo", ["sha256", "xxh64"])
def test_no_public_prefix_keys_exactly_as_before(algo):
    """P = 0 is today's keying: the salt in block 0's extra keys, nothing in the others."""
    prompt = SYSTEM + SECRET_A + [42]
    rig = Rig(cfg(hash_algo=algo))
    rig.prefill("A", prompt, "a")
    assert set(rig.m.index.keys()) == set(chain(prompt, [salt_extra("a"), (), (), ()], algo))
    rig.free("A")
    # And a public prefix moves the salt from block 0 to block P, and nothing else.
    rig.prefill("B", prompt, "a", public=8)
    assert set(chain(prompt, [(), (), salt_extra("a"), ()], algo)) <= set(rig.m.index.keys())
    assert rig.m.keying("B") == Keying("a", 2)


# -- sharing ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["block", "token"])
def test_public_blocks_are_shared_across_salts(granularity):
    rig = Rig(cfg(prefix_granularity=granularity, num_blocks=12))
    assert rig.prefill("A", SYSTEM + SECRET_A + [0], "a", public=8) == 0
    assert rig.prefill("B", SYSTEM + SECRET_B, "b", public=8) == 8
    assert rig.m.block_table("B")[:2] == rig.m.block_table("A")[:2]
    assert rig.m.stats.prefix_cache_hits == rig.m.stats.prefix_cache_hits_public == 8
    contents = [rig.m.index.content(b) for b in rig.m.block_table("A")]
    assert [c.namespace for c in contents] == [None, None, "a", "a", "a"]
    clean(rig, "A", "B")


@pytest.mark.parametrize("granularity", ["block", "token"])
@pytest.mark.parametrize("declared", [8, 10, 16, 17])
def test_private_blocks_are_never_found_under_another_salt(granularity, declared):
    """Whatever the reader declares public, it reaches the writer's blocks only up to the writer's own public
    blocks: the writer's private blocks (block 2 on) are keyed under its salt, and so is the trie group of its
    private partial blocks (the token-granular path)."""
    for prompt in (
        SYSTEM + SECRET_A + [0, 1],  # the very same prompt
        SYSTEM + SECRET_A[:2],  # a guess that ends inside a private block
        SYSTEM + SECRET_A[:5],  # one private block and a bit
    ):
        # A fresh cache each time: a reader that declares SECRET_A public publishes it for the next one.
        rig = Rig(cfg(prefix_granularity=granularity, num_blocks=16))
        rig.prefill("A", SYSTEM + SECRET_A + [0, 1], "a", public=8)
        # Salt-free readers are public throughout, and still find only the public blocks.
        assert rig.m.lookup(SYSTEM + SECRET_A + [0, 1], None, 0) == 8
        # The writer's own salt and keying finds its private blocks (all but the last prompt token, or whole blocks).
        assert rig.m.lookup(SYSTEM + SECRET_A + [0, 1], "a", 8) == (17 if granularity == "token" else 16)
        public = min(declared, len(prompt))
        assert rig.m.lookup(prompt, "b", public) == 8
        assert rig.prefill("B", prompt, "b", public=public) == 8, prompt
        clean(rig, "A", "B")


def test_the_partial_block_at_the_boundary_is_private():
    rig = Rig(cfg(num_blocks=12))  # token granularity: partial hits are possible
    prompt = SYSTEM + [50, 51, 52]
    rig.prefill("A", prompt, "a", public=10)  # 10 tokens declared: blocks 0, 1 public; block 2 private
    assert rig.m.keying("A") == Keying("a", 2)
    assert rig.m.index.content(rig.m.block_table("A")[2]).namespace == "a"
    assert rig.prefill("B", [*SYSTEM, 50, 51, 60], "b", public=10) == 8  # not 10: block 2 is a's
    assert rig.prefill("A2", [*SYSTEM, 50, 51, 60], "a", public=10) == 10  # a's own keying does reach it
    clean(rig, "A", "B", "A2")


def test_a_reader_declaring_fewer_public_blocks_misses_the_rest():
    """Conservative, not a leak: past its own declaration the reader's lookup carries its salt."""
    rig = Rig(cfg(num_blocks=12))
    prompt = SYSTEM + SECRET_A + [0]
    rig.prefill("A", prompt, "a", public=16)  # four public blocks
    assert [rig.m.lookup(prompt, "b", p) for p in (0, 4, 8, 12, 16)] == [0, 4, 8, 12, 16]
    # The writer itself under another boundary is another keying too.
    assert rig.m.lookup(prompt, "a", 8) == 8 and rig.m.lookup(prompt, "a", 0) == 0


def test_a_salt_free_writer_is_public_and_a_salted_reader_finds_it_only_in_its_public_blocks():
    rig = Rig(cfg(num_blocks=12))
    rig.prefill("A", SYSTEM + SECRET_A + [0], None)
    assert rig.m.lookup(SYSTEM + SECRET_A + [0], "b", 0) == 0
    assert rig.m.lookup(SYSTEM + SECRET_A + [0], "b", 8) == 8
    assert rig.prefill("B", SYSTEM + SECRET_B, "b", public=8) == 8
    clean(rig, "A", "B")


def test_forks_keep_the_keying_and_public_blocks_must_lie_in_the_prompt():
    rig = Rig(cfg(num_blocks=12))
    rig.prefill("A", SYSTEM + SECRET_B, "a", public=8)
    rig.fork("A", "A1")
    assert rig.m.keying("A1") == rig.m.keying("A") == Keying("a", 2)
    rig.feed("A1", [7])
    clean(rig, "A", "A1")
    for bad in (12, -1):
        with pytest.raises(ValueError, match="public_prefix_tokens"):
            rig.m.lookup(SYSTEM + SECRET_B, "a", bad)
        with pytest.raises(ValueError, match="public_prefix_tokens"):
            rig.m.allocate("X", SYSTEM + SECRET_B, "a", public_prefix_tokens=bad)
    assert not rig.m.has_request("X")


# -- eviction and reset -------------------------------------------------------------------------------------
def test_eviction_and_reset_treat_public_and_private_blocks_alike():
    rig = Rig(cfg(num_blocks=8))
    rig.prefill("A", SYSTEM + SECRET_A + [0], "a", public=8)  # blocks 0, 1 public; 2, 3, 4 private
    table = rig.m.block_table("A")
    rig.free("A")
    # Tail first, as for any prefix: the private suffix is evicted before the public blocks it follows.
    assert rig.m.free_order()[-5:] == table[::-1]
    assert rig.prefill("C", list(range(200, 212)), "c") == 0  # three blocks: the free ones, then two of a's
    assert rig.m.stats.evictions == 0
    rig.prefill("D", list(range(300, 308)), "d")  # two more: a's block 4 and 3 go, in LRU order
    assert rig.m.stats.evictions == 2
    assert rig.m.lookup(SYSTEM + SECRET_A + [0], "a", 8) == 12  # the chain up to a's block 2 survives
    assert rig.m.lookup(SYSTEM + SECRET_B, "b", 8) == 8
    rig.free("C")
    rig.free("D")
    assert rig.m.reset_prefix_cache()
    assert rig.m.lookup(SYSTEM + SECRET_B, "b", 8) == 0 and rig.m.lookup(SYSTEM + SECRET_A + [0], "a", 8) == 0
    check_invariants(rig.m)


# -- the checks have teeth ----------------------------------------------------------------------------------
def test_the_invariant_catches_a_request_holding_another_salts_private_block():
    rig = Rig(cfg(num_blocks=12))
    rig.prefill("A", SYSTEM + SECRET_A + [0], "a", public=8)
    rig.prefill("B", SYSTEM + SECRET_B, "b", public=8)
    check_invariants(rig.m)
    block = rig.m.block_table("B")[2]
    content = rig.m.index.content(block)
    rig.m.index._content[block] = dataclasses.replace(content, namespace="a")  # as if b had hit a's block
    with pytest.raises(InvariantError, match="private to salt 'a'"):
        check_invariants(rig.m)


def test_the_sanitizer_allows_reads_of_blocks_both_declared_public_and_nothing_else():
    san = KVSanitizer(num_blocks=4, block_size=2)
    toks = [5, 6, 7, 8]
    ctx = prefix_digests(toks)
    pos = [0, 1, 2, 3]
    san.record_write("A", [0, 1, 2, 3], toks, pos, step=1, context=ctx, namespace=Namespace("a", 1))
    # b declared two public blocks, but a only one: slots 2, 3 (a's block 1) are a's private K/V.
    found = san.check_read("B", [0, 1, 2, 3], toks, pos, step=2, context=ctx, namespace=Namespace("b", 2))
    assert [(v.kind, v.position, v.writer) for v in found] == [("cross-tenant", 2, "A"), ("cross-tenant", 3, "A")]
    assert "another cache salt" in found[0].explain()
    # a's own reads and b's reads of what both declared public are fine; so is a salt-free reader's public part.
    assert san.check_read("A", [0, 1, 2, 3], toks, pos, step=3, context=ctx, namespace=Namespace("a", 0)) == []
    assert san.check_read("B", [0, 1], toks[:2], pos[:2], step=3, context=ctx[:2], namespace=Namespace("b", 1)) == []
    assert san.check_read("C", [0, 1], toks[:2], pos[:2], step=3, context=ctx[:2], namespace=Namespace(None)) == []
    # b reading a's public block from one of its own private blocks is a violation too.
    [v] = san.check_read("B", [0], toks[:1], pos[:1], step=4, namespace=Namespace("b", 0))
    assert v.kind == "cross-tenant"
    # A slot whose content is wrong is reported once, as foreign; without namespaces nothing else is checked.
    [v] = san.check_read("B", [0], [9], [0], step=5, namespace=Namespace("b", 0))
    assert v.kind == "foreign"
    assert san.check_read("B", [2, 3], toks[2:], pos[2:], step=5) == []
    # Copies carry the writer's namespace; reset forgets it.
    san.copy_blocks([(1, 3)])
    [v, _] = san.check_read("B", [6, 7], toks[2:], pos[2:], step=6, namespace=Namespace("b", 9))
    assert v.kind == "cross-tenant" and v.block == 3
    san.reset()
    san.record_write("A", [0], [5], [0], step=1)
    assert san.check_read("B", [0], [5], [0], step=2, namespace=Namespace("b", 0)) == []


def test_declaring_ones_own_text_public_publishes_it():
    """The consent rule: marking tokens public is marking them readable by every salt (that sends them)."""
    rig = Rig(cfg(num_blocks=12))
    rig.prefill("A", SYSTEM + SECRET_A + [0], "a", public=16)
    assert rig.prefill("B", SYSTEM + SECRET_A + [9], "b", public=16) == 16
    assert rig.m.stats.prefix_cache_hits_public == 16
    clean(rig, "A", "B")
