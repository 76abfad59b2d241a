"""Public prefixes in the engine: blocks shared across cache salts, tokens unchanged against the dense oracle,
and the sanitizer and invariants watching that nothing private crosses salts."""

from __future__ import annotations

import random

import pytest

from kvlab import Engine, SamplingParams
from kvlab.config import CacheConfig, SchedulerConfig
from kvlab.engine.sampling import InvalidRequestError
from kvlab.kv import check_invariants
from oracle_cache import check_against_oracle, mini

BS = 4
SYSTEM = tuple(range(60, 78))  # 18 tokens: four full public blocks and half of a private one


def greedy(max_tokens: int = 4, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


def engine(**cache) -> Engine:
    return Engine(
        mini(),
        CacheConfig(**{"block_size": BS, "num_blocks": 64, "sanitize": True, **cache}),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128),
    )


def run(eng: Engine) -> None:
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        check_invariants(eng.kv)
        steps += 1
        assert steps < 2000


def test_the_public_prefix_is_shared_across_tenants_and_the_private_rest_is_not():
    eng = engine()
    a = eng.add_request([*SYSTEM, 1, 2, 3], greedy(), "a", cache_salt="a", public_prefix_tokens=len(SYSTEM))
    run(eng)
    # b sends the same system prompt and then a's very text: only the public blocks hit (16 of 18 tokens).
    b = eng.add_request([*SYSTEM, 1, 2, 3], greedy(), "b", cache_salt="b", public_prefix_tokens=len(SYSTEM))
    run(eng)
    assert eng.output(b).num_cached_tokens == 16
    # A request of a's own salt and keying finds a's private blocks too.
    a2 = eng.add_request([*SYSTEM, 1, 2, 3, 4], greedy(), "a2", cache_salt="a", public_prefix_tokens=len(SYSTEM))
    # A reader that declares nothing public finds nothing of another salt.
    c = eng.add_request([*SYSTEM, 9], greedy(), "c", cache_salt="c")
    run(eng)
    assert eng.output(a2).num_cached_tokens == 21
    assert eng.output(c).num_cached_tokens == 0
    assert eng.stats().prefix_cache_hits_public == 16 + 16
    for rid in (a, b, a2, c):
        out = eng.output(rid)
        assert check_against_oracle("mini", tuple(out.prompt_token_ids), 4, tuple(out.token_ids))
    assert eng.violations == []


def test_tenants_admitted_together_compute_their_public_prefix_once():
    """The scheduler holds back a request whose public blocks another request of this step is computing,
    whatever its salt: the prefix becomes a hit instead of a second computation."""
    eng = engine()
    ids = [
        eng.add_request([*SYSTEM, 5 + i], greedy(2), f"t{i}", cache_salt=f"t{i}", public_prefix_tokens=16)
        for i in range(3)
    ]
    run(eng)
    assert [eng.output(r).num_cached_tokens for r in ids] == [0, 16, 16]
    # Without a public prefix, tenants never wait for each other (nothing of one is the other's).
    eng = engine()
    ids = [eng.add_request([*SYSTEM, 5 + i], greedy(2), f"u{i}", cache_salt=f"u{i}") for i in range(2)]
    run(eng)
    assert [eng.output(r).num_cached_tokens for r in ids] == [0, 0]


@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_random_tenants_with_public_prefixes_match_the_dense_oracle(granularity: str, layout: str):
    rng = random.Random(f"{granularity}/{layout}")
    systems = [tuple(rng.randrange(256) for _ in range(rng.randint(4, 40))) for _ in range(3)]
    eng = Engine(
        mini(),
        CacheConfig(block_size=BS, num_blocks=40, layout=layout, prefix_granularity=granularity, sanitize=True),
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128),
    )
    pending = []
    for i in range(24):
        system = rng.choice(systems)
        prompt = system + tuple(rng.randrange(256) for _ in range(rng.randint(1, 30)))
        # Most declare their system prompt public; some more (their own text, published), less, or nothing.
        public = rng.choice([len(system)] * 3 + [0, rng.randint(0, len(prompt)), len(prompt)])
        pending.append((rng.randint(0, 10), i, prompt, public, rng.choice([None, "t1", "t2", "t3"]), rng.randint(1, 6)))
    pending.sort()
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i, prompt, public, salt, max_tokens = pending.pop(0)
            n = 2 if i % 7 == 0 else 1  # forks carry the keying
            eng.add_request(list(prompt), greedy(max_tokens, n), str(i), cache_salt=salt, public_prefix_tokens=public)
        eng.step()
        check_invariants(eng.kv)
        step += 1
        assert step < 5000
    for i in range(24):
        out = eng.output(str(i))
        for c in out.outputs:
            check_against_oracle("mini", tuple(out.prompt_token_ids), len(c.token_ids), tuple(c.token_ids))
    assert eng.violations == []
    assert eng.stats().prefix_cache_hits_public > 0
    assert eng.kv.num_free_blocks() == 40


def test_public_prefix_tokens_is_validated():
    eng = engine()
    for bad in (-1, 4, True, 1.5):
        with pytest.raises(InvalidRequestError, match="public_prefix_tokens"):
            eng.add_request([1, 2, 3], greedy(), cache_salt="a", public_prefix_tokens=bad)  # type: ignore[arg-type]
    assert not eng.has_unfinished_requests()
    eng.add_request("abc", greedy(), cache_salt="a", public_prefix_tokens=3)  # the whole prompt may be public


def test_without_prefix_sharing_a_public_prefix_changes_nothing():
    eng = engine(share_prefix=False)
    for salt in ("a", "b"):
        eng.add_request([*SYSTEM, 1], greedy(), salt, cache_salt=salt, public_prefix_tokens=len(SYSTEM))
    run(eng)
    assert [eng.output(r).num_cached_tokens for r in ("a", "b")] == [0, 0]
    assert eng.output("a").token_ids == eng.output("b").token_ids
    assert eng.violations == []


def test_a_prefix_k_tenants_computed_is_promoted_and_shared():
    """promote_after=2: once two tenants computed the same undeclared prefix, a third tenant's request computes
    the public copy and every later one hits it, tokens equal to the dense oracle, the sanitizer (counting
    the writers' tenants itself) and the invariants silent."""
    eng = engine(promote_after=2)
    cached = []
    for i, salt in enumerate(["a", "b", "c", "d", "a"]):
        rid = eng.add_request([*SYSTEM, 10 + i], greedy(), f"r{i}", cache_salt=salt, tenant=salt)
        run(eng)
        cached.append(eng.output(rid).num_cached_tokens)
        out = eng.output(rid)
        assert check_against_oracle("mini", tuple(out.prompt_token_ids), 4, tuple(out.token_ids))
    assert cached == [0, 0, 0, 16, 16]
    assert eng.kv.stats.promotions == 4 and eng.stats().prefix_cache_hits_public == 32
    assert eng.violations == []


def test_random_tenants_with_promotion_match_the_dense_oracle():
    rng = random.Random("promotion")
    systems = [tuple(rng.randrange(256) for _ in range(rng.randint(8, 30))) for _ in range(2)]
    eng = engine(promote_after=2, num_blocks=48)
    ids = []
    for i in range(30):
        prompt = list(rng.choice(systems)) + [rng.randrange(256) for _ in range(rng.randint(1, 12))]
        tenant = rng.choice(["t1", "t2", "t3"])
        salt = f"{tenant}/{rng.randrange(2)}"  # each tenant under two salts: one party
        ids.append(eng.add_request(prompt, greedy(rng.randint(1, 5)), str(i), cache_salt=salt, tenant=tenant))
        if i % 3 == 2:
            run(eng)
    run(eng)
    for rid in ids:
        out = eng.output(rid)
        c = out.outputs[0]
        assert check_against_oracle("mini", tuple(out.prompt_token_ids), len(c.token_ids), tuple(c.token_ids))
    assert eng.kv.stats.promotions > 0 and eng.stats().prefix_cache_hits_public > 0
    assert eng.violations == []


def test_llm_generate_takes_public_prefixes_and_promote_after():
    from kvlab import LLM

    llm = LLM("mini", block_size=BS, num_blocks=64)
    prompt = [*SYSTEM, 1, 2]
    outs = llm.generate([prompt, prompt], greedy(), cache_salts=["a", "b"], public_prefix_tokens=len(SYSTEM))
    assert [o.num_cached_tokens for o in outs] == [0, 16]  # the same step: b waits a step for a's public blocks
    # One bad value (longer than its prompt) is that prompt's error; the others run.
    outs = llm.generate([prompt, [*SYSTEM, 3]], greedy(), cache_salts=["c", "d"], public_prefix_tokens=[99, 16])
    assert outs[0].finish_reason == "error" and "public_prefix_tokens=99" in (outs[0].error or "")
    assert outs[1].num_cached_tokens == 16 and len(outs[1].token_ids) == 4
    with pytest.raises(ValueError, match="2 public_prefix_tokens for 1 prompts"):
        llm.generate([prompt], greedy(), public_prefix_tokens=[1, 2])
    promoting = LLM("mini", block_size=BS, num_blocks=64, promote_after=2)
    promoting.generate([prompt], greedy(), cache_salts=["a1"])
    promoting.generate([prompt], greedy(), cache_salts=["a2"])  # the default tenant under a second salt: one party
    assert promoting.stats().prefix_cache_hits_public == 0
    promoting.generate([prompt], greedy(), cache_salts=["b"], tenants=["b"])
    with pytest.raises(ValueError, match="2 tenants for 1 prompts"):
        promoting.generate([prompt], greedy(), tenants=["a", "b"])
    outs = [promoting.generate([prompt], greedy(), cache_salts=[s], tenants=[s])[0] for s in ("c", "d")]
    assert [o.num_cached_tokens for o in outs] == [0, 19]  # all five prompt blocks promoted; the last token recomputed
