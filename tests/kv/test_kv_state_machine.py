"""Random allocate / append / fork / free / reset sequences over small pools.

After every step the manager's invariants hold and, for safe configurations, no live request reads K/V that
is not its own (checked by the sanitizer and by decoding the storage). Requests come from four namespaces
(no salt, salts "s", "t" and "u"; "s" and "t" are two salts of one tenant, as a server's client may choose) and
declare public prefixes of any length; some pools promote what K = 2 or 3 tenants computed (``promote_after``):
after every step no request reads another salt's K/V outside the blocks both declared public or K tenants wrote
(the sanitizer and the storage's writer codes, each counting tenants on its own, and ``check_invariants``'
namespace rule all say so), and no block is public by promotion unless K distinct tenants wrote it. Unsafe
configurations may leak but must never corrupt the pool itself. At the end, freeing everything returns every
block.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_rig import Rig

from kvlab.config import CacheConfig
from kvlab.kv import check_invariants

VOCAB = st.integers(0, 3)  # a tiny vocabulary makes near-miss prompts (and weak-hash collisions) common
MAX_TOKENS = 40
# Prompts are a cut of one of a few base prompts plus a random tail, so that prefixes are often shared.
# The periodic base repeats the same block tokens at different positions: only the chain tells them apart.
BASES = [[rng.randrange(4) for _ in range(24)] for rng in map(random.Random, range(2))] + [[0, 3, 2, 1] * 6]


def _prompt(k: int, cut: int, tail: list[int], swap: tuple[int, int] | None) -> list[int]:
    prompt = BASES[k][:cut] + tail or [0]
    if swap is not None:  # a near miss: the same tokens with two of them swapped
        i, j = (x % len(prompt) for x in swap)
        prompt[i], prompt[j] = prompt[j], prompt[i]
    return prompt


PROMPTS = st.builds(
    _prompt,
    st.integers(0, len(BASES) - 1),
    st.sampled_from([24, 20, 16, 12, 8, 4, 0]),
    st.lists(VOCAB, max_size=6),
    st.none() | st.tuples(st.integers(0, 29), st.integers(0, 29)),
)
SHARE = st.sampled_from([True, True, True, False])
SALTS = st.sampled_from([None, None, "s", "t", "u"])
TENANT_OF = {None: None, "s": "A", "t": "A", "u": "B"}  # two salts of one tenant: one party for promotion
# A public prefix in tokens, cut to the prompt: often none, often whole blocks of the shared bases, any length too.
PUBLIC = st.sampled_from([0, 0, 4, 8, 12, 16, 24]) | st.integers(0, 30)

# Isolation-safe settings. The weak hash is flagged unsafe by CacheConfig, but with verification on it must
# never share wrong state: a colliding key is rejected by the token and parent check.
SAFE = st.builds(
    lambda algo, **kw: CacheConfig(hash_algo=algo, unsafe=algo == "weak", **kw),
    st.sampled_from(["sha256", "xxh64", "weak"]),
    block_size=st.integers(1, 8),
    num_blocks=st.integers(2, 32),
    share_prefix=SHARE,
    prefix_granularity=st.sampled_from(["token", "block"]),
    layout=st.sampled_from(["NHD", "HND"]),
    cow_check=st.sampled_from(["write", "allocate"]),
    promote_after=st.sampled_from([None, 2, 2, 3]),
    eviction=st.sampled_from(["lru", "fair"]),
)

UNSAFE = st.builds(
    CacheConfig,
    block_size=st.integers(1, 8),
    num_blocks=st.integers(2, 32),
    copy_on_write=st.booleans(),
    reference_counting=st.booleans(),
    prefix_granularity=st.sampled_from(["token", "block"]),
    hash_algo=st.sampled_from(["sha256", "weak"]),
    verify_tokens=st.booleans(),
    cow_check=st.sampled_from(["write", "allocate"]),
    unsafe=st.just(True),
)


def live(self) -> bool:
    return bool(self.rig.tokens)


def written_blocks(rig: Rig, rid: str) -> list[int]:
    """The blocks of the request's table it will still write into: its partial frontier and reserved blocks."""
    return rig.m.block_table(rid)[len(rig.tokens[rid]) // rig.config.block_size :]


def fork_has_room(rig: Rig, parent: str) -> bool:
    """Whether the pool holds every copy target a fork of ``parent`` sets aside: for each of its blocks, the
    copies due once the child holds it too (one per writer but the last holder) beyond those already reserved.
    The child's own copies are among them. (Counting only the child's written blocks is not enough: blocks the
    parent already shares with writers of an earlier fork take targets for those writers too.)"""
    m = rig.m
    written = set(written_blocks(rig, parent))
    reserve = m.cow_reserve()
    need = 0
    for b in dict.fromkeys(m.block_table(parent)):
        holders, writers = m.refcount(b) + 1, m.writers(b) + (b in written)
        need += max(0, min(writers, holders - 1) - len(reserve.get(b, ())))
    return m.num_free_blocks() >= need


def decides_at_allocation(config: CacheConfig) -> bool:
    return config.cow_check == "allocate" and config.copy_on_write


def make_machine(configs: st.SearchStrategy[CacheConfig], safe: bool) -> type:
    class KVCacheMachine(RuleBasedStateMachine):
        rig: Rig

        @initialize(config=configs)
        def setup(self, config: CacheConfig) -> None:
            self.rig = Rig(config)
            self.prompts: dict[str, list[int]] = {}
            self.reserved: set[str] = set()  # admitted requests whose prompt blocks are all set aside
            self.count = 0

        def _new_id(self) -> str:
            self.count += 1
            return f"r{self.count}"

        def _pick(self, pick: int) -> str:
            ids = sorted(self.rig.tokens)
            return ids[pick % len(ids)]

        @rule(prompt=PROMPTS, salt=SALTS, whole=st.booleans(), public=PUBLIC)
        def allocate(self, prompt: list[int], salt: str | None, whole: bool, public: int) -> None:
            rid = self._new_id()
            before = self.rig.snapshot()
            public = min(public, len(prompt))
            cached = self.rig.admit(rid, prompt, salt, public, tenant=TENANT_OF[salt])
            if cached is None:
                assert self.rig.snapshot() == before
                return
            assert 0 <= cached <= len(prompt) - 1
            if not self.rig.config.share_prefix:
                assert cached == 0
            self.prompts[rid] = prompt
            self.reserved.add(rid)
            if decides_at_allocation(self.rig.config):  # every block it will write into is its own already
                assert all(self.rig.m.refcount(b) == 1 for b in written_blocks(self.rig, rid))
            if whole:  # prefill in the same breath, as an engine without chunking would
                self._append(rid, len(prompt), [])

        @precondition(live)
        @rule(pick=st.integers(0, 99), n=st.integers(1, 12), decode=st.lists(VOCAB, min_size=12, max_size=12))
        def append(self, pick: int, n: int, decode: list[int]) -> None:
            self._append(self._pick(pick), n, decode)

        def _append(self, rid: str, n: int, decode: list[int]) -> None:
            done, prompt = len(self.rig.tokens[rid]), self.prompts[rid]
            in_prompt = done < len(prompt)
            tokens = prompt[done : done + n] if in_prompt else decode[:n]
            tokens = tokens[: MAX_TOKENS - done]
            if not tokens:
                return
            before = self.rig.snapshot()
            alloc = self.rig.feed(rid, tokens)
            if alloc is None:
                # An admitted prompt has all its blocks and copy-on-write targets set aside.
                assert not (safe and in_prompt and rid in self.reserved)
                assert self.rig.snapshot() == before
            else:
                assert len(alloc.slots) == len(tokens)
                # Unsafe frees can hand a request's own block back to it, so slots may then repeat.
                assert not safe or len(set(alloc.slots)) == len(tokens)

        @precondition(live)
        @rule(pick=st.integers(0, 99), roll=st.integers(0, 2))
        def fork(self, pick: int, roll: int) -> None:
            if roll != 1:  # rarer than allocations, or forks crowd out new prompts (0 is what Hypothesis
                return  # draws most, so it must not be the value that acts)
            parent, child = self._pick(pick), self._new_id()
            shared = set(self.rig.m.block_table(parent))
            room = fork_has_room(self.rig, parent)
            copies = self.rig.fork(parent, child)
            if not decides_at_allocation(self.rig.config):
                assert copies == []
            elif safe and room:  # the child copied (or swapped) every block it will write into
                assert all(self.rig.m.refcount(b) == 1 for b in written_blocks(self.rig, child))
            self.prompts[child] = self.prompts[parent]
            # A fork sets copy targets aside only while the pool has room: co-holders lose the promise.
            self.reserved -= {r for r in self.reserved if shared & set(self.rig.m.block_table(r))}

        @precondition(live)
        @rule(pick=st.integers(0, 99))
        def free(self, pick: int) -> None:
            rid = self._pick(pick)
            self.rig.free(rid)
            del self.prompts[rid]
            self.reserved.discard(rid)

        @rule(
            prompt=PROMPTS,
            cut=st.integers(1, 30),
            tail=st.lists(VOCAB, max_size=6),
            salt=SALTS,
            public=PUBLIC,
        )
        def rerun_prefix(self, prompt: list[int], cut: int, tail: list[int], salt: str | None, public: int) -> None:
            """Running (and freeing) a prefix of a cached context, maybe going on with other tokens, must
            leave the whole context findable: only an eviction may lose a cached block (the lost-cache-hit
            defect class: a recomputed identical token, or a divergent write in place, orphaned the chain)."""
            m = self.rig.m
            public = min(public, len(prompt))
            before, evictions = m.lookup(prompt, salt, public), m.stats.evictions
            rid = self._new_id()
            rerun = prompt[:cut] + tail
            if self.rig.prefill(rid, rerun, salt, min(public, len(rerun)), tenant=TENANT_OF[salt]) is None:
                return
            if safe:
                assert self.rig.check(rid) == [] and self.rig.foreign(rid) == {} and self.rig.crossed(rid) == {}
            self.rig.free(rid)
            if safe and m.stats.evictions == evictions:
                assert m.lookup(prompt, salt, public) >= before

        @rule(
            x0=st.lists(VOCAB, min_size=8, max_size=8),
            b=st.lists(VOCAB, min_size=8, max_size=8),
            c=st.lists(VOCAB, min_size=8, max_size=8),
            salt=SALTS,
        )
        def sibling_chains(self, x0: list[int], b: list[int], c: list[int], salt: str | None) -> None:
            """Chains that differ only above a block: X0 + B, then Y0 + C, then Y0 + B, where Y0 is X0 reversed (the
            weak hash's colliding key for the same tokens under another parent). Y0 + B may find Y0, never X's B."""
            bs = self.rig.config.block_size
            y0 = x0[:bs][::-1]
            for prompt in (x0[:bs] + b[:bs] + [0], y0 + c[:bs] + [0], y0 + b[:bs] + [0]):
                rid = self._new_id()
                if self.rig.prefill(rid, prompt, salt, tenant=TENANT_OF[salt]) is None:
                    return
                if safe:
                    assert self.rig.check(rid) == [] and self.rig.foreign(rid) == {} and self.rig.crossed(rid) == {}
                self.rig.free(rid)

        @rule(roll=st.integers(0, 19))
        def reset(self, roll: int) -> None:
            if roll != 1:  # keep resets rare so that caches get a chance to fill
                return
            in_use = self.rig.m.usage() > 0
            before = self.rig.snapshot()
            done = self.rig.m.reset_prefix_cache()
            assert done is not in_use
            if not done:
                assert self.rig.snapshot() == before
            elif self.rig.m.index is not None:
                assert self.rig.m.index.keys() == {} and self.rig.m.index.contents() == {}

        @invariant()
        def consistent(self) -> None:
            if not hasattr(self, "rig"):
                return
            check_invariants(self.rig.m)
            s = self.rig.m.stats
            assert s.cow_copies_unneeded <= s.cow_copies_eager <= s.cow_copies
            assert s.cow_bytes == s.cow_copies * self.rig.storage.block_nbytes
            if self.rig.config.cow_check == "write":
                assert s.cow_copies_eager == 0
            if safe:
                assert self.rig.storage.blocks_copied == s.cow_copies  # every copy counted was applied
                for rid in self.rig.tokens:
                    assert self.rig.check(rid) == []  # the sanitizer: neither foreign nor cross-tenant reads
                    assert self.rig.foreign(rid) == {}
                    # No cross-tenant hit outside public blocks, by the storage's writer codes.
                    assert self.rig.crossed(rid) == {}
            self._promoted_only_what_k_tenants_wrote()

        def _promoted_only_what_k_tenants_wrote(self) -> None:
            """Every block public by promotion was written under a salt by K distinct tenants (the rig's count,
            apart from the manager's): the salts of one tenant never add up to a second party."""
            k = self.rig.config.promote_after
            if k is None or not self.rig.config.share_prefix:
                return
            bs = self.rig.config.block_size
            for base in BASES:
                promoted = self.rig.m.keying_of(base, "probe").public_blocks
                for pos in range(promoted * bs):
                    assert len(self.rig.tenants_that_wrote(base[: pos + 1])) >= k, (base, pos, promoted)

        def teardown(self) -> None:
            if not hasattr(self, "rig"):
                return
            for rid in list(self.rig.tokens):
                self.rig.free(rid)
            check_invariants(self.rig.m)
            assert self.rig.m.num_free_blocks() == self.rig.m.num_blocks
            assert self.rig.m.usage() == 0.0
            assert self.rig.m.cow_reserve() == {}
            assert self.rig.m.reset_prefix_cache()

    return KVCacheMachine


FAST = settings(max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SafeCacheMachine = make_machine(SAFE, safe=True)
SafeCacheMachine.TestCase.settings = FAST
TestSafeConfigsNeverReadForeignKV = SafeCacheMachine.TestCase

UnsafeCacheMachine = make_machine(UNSAFE, safe=False)
UnsafeCacheMachine.TestCase.settings = settings(FAST, max_examples=60)
TestUnsafeConfigsNeverBreakThePool = UnsafeCacheMachine.TestCase


def test_a_stale_table_copying_away_from_a_freed_block_keeps_the_pool_consistent():
    """Regression (found by the unsafe machine): without reference counts, r11's free released blocks r13
    had just taken; r13 wrote into one, so r2, holding the same block at another position in its own stale
    table, copied away from it, and the copy's release decremented a refcount already at 0."""
    machine = UnsafeCacheMachine()
    machine.setup(
        CacheConfig(
            block_size=1,
            num_blocks=26,
            reference_counting=False,
            prefix_granularity="token",
            verify_tokens=False,
            unsafe=True,
        )
    )
    prompt = _prompt(0, 24, [], None)
    admit = {"prompt": prompt, "public": 0, "salt": None, "whole": False}
    fork = {"pick": 0, "roll": 1}
    rerun = {"cut": 1, "prompt": prompt, "public": 0, "salt": None}
    steps = [
        ("allocate", admit),
        ("fork", fork),
        *[("allocate", admit)] * 4,
        ("free", {"pick": 0}),
        *[("allocate", admit)] * 2,
        ("rerun_prefix", {**rerun, "tail": []}),
        ("fork", fork),
        ("fork", fork),
        ("append", {"decode": [0] * 12, "n": 1, "pick": 0}),
        ("rerun_prefix", {**rerun, "tail": [0]}),
        ("free", {"pick": 0}),
        ("allocate", admit),
        ("free", {"pick": 0}),
        ("append", {"decode": [0] * 12, "n": 2, "pick": 0}),
        ("append", {"decode": [0] * 12, "n": 3, "pick": 1}),
    ]
    for name, kwargs in steps:
        getattr(machine, name)(**kwargs)
        machine.consistent()
    machine.teardown()
