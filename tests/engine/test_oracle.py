"""Every engine path against the dense oracle: greedy tokens must be identical to each request run
alone with no cache, whatever the batching, chunking, preemption, sharing, layout or attention kind."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import pytest

from kvlab import Engine, SamplingParams
from kvlab.config import CacheConfig, SchedulerConfig
from kvlab.kv import check_invariants
from oracle_cache import check_against_oracle, mini


@dataclass
class Workload:
    arrivals: list[tuple[int, tuple[int, ...], int]]  # (arrival step, prompt ids, max_tokens)


def make_workload(seed: int, n_max: int = 24) -> Workload:
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(256) for _ in range(rng.randint(8, 60))) for _ in range(3)]
    arrivals = []
    for _ in range(rng.randint(1, n_max)):
        prefix = rng.choice(systems) if rng.random() < 0.8 else ()
        suffix = tuple(rng.randrange(256) for _ in range(rng.randint(1, 40)))
        prompt = (prefix + suffix)[:100]
        arrivals.append((rng.randint(0, 12), prompt, rng.randint(1, 12)))
    return Workload(arrivals)


def run_engine(model: str, w: Workload, cache: CacheConfig, sched: SchedulerConfig) -> tuple[dict, Engine]:
    eng = Engine(mini(model), cache, sched)
    pending = sorted(enumerate(w.arrivals), key=lambda x: x[1][0])
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens) = pending.pop(0)
            eng.add_request(
                list(prompt),
                SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                request_id=str(i),
            )
        eng.step()
        check_invariants(eng.kv)
        step += 1
        assert step < 5000, "engine made no progress"
    return {i: tuple(eng.output(str(i)).token_ids) for i in range(len(w.arrivals))}, eng


STRATEGIES = {
    "isolated": dict(share_prefix=False),
    "shared-cow": dict(share_prefix=True),
}


@pytest.mark.parametrize("model", ["mini", "mini-gqa", "mini-mqa"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("granularity", ["token", "block"])
def test_random_workloads_match_dense_oracle(model: str, strategy: str, layout: str, granularity: str) -> None:
    seed = zlib.crc32(f"{model}/{strategy}/{layout}/{granularity}".encode()) % 10_000  # same on every run
    for k, (block_size, num_blocks, budget) in enumerate([(4, 40, 24), (8, 24, 64), (16, 64, 512)]):
        w = make_workload(seed * 10 + k)
        cache = CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            layout=layout,
            prefix_granularity=granularity,
            sanitize=True,
            **STRATEGIES[strategy],
        )
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=128)
        got, eng = run_engine(model, w, cache, sched)
        for i, (_, prompt, max_tokens) in enumerate(w.arrivals):
            check_against_oracle(model, prompt, max_tokens, got[i])
        assert eng.violations == []
        assert eng.kv.num_free_blocks() == num_blocks  # everything freed at the end


def test_tight_pool_forces_preemption_and_small_budget_forces_chunking() -> None:
    # The workloads above are meant to exercise preemption and chunked prefill; prove this one does.
    rng = random.Random(5)
    system = tuple(rng.randrange(256) for _ in range(40))
    w = Workload([(0, system + tuple(rng.randrange(256) for _ in range(rng.randint(5, 50))), 12) for _ in range(16)])
    cache = CacheConfig(block_size=4, num_blocks=30, sanitize=True)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128)
    got, eng = run_engine("mini", w, cache, sched)
    assert eng.stats().num_preemptions > 0
    assert eng.stats().prefix_cache_hits > 0
    assert any(len(p) > 16 for _, p, _ in w.arrivals)  # longer than the budget: prefilled in chunks
    for i, (_, prompt, max_tokens) in enumerate(w.arrivals):
        assert check_against_oracle("mini", prompt, max_tokens, got[i])
    assert eng.violations == []
