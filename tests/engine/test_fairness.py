"""No request may buy the engine: tenants share seats and blocks fairly, and a logprobs request costs its
length, not its length squared. Everything is counted in engine steps and calls, never in seconds."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from kvlab import Engine, SamplingParams
from kvlab.config import CacheConfig, SchedulerConfig
from kvlab.kv import check_invariants
from oracle_cache import check_against_oracle, mini

FLOOD = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=4)
SINGLE = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _ttft_steps(engine: Engine, rid: str, limit: int = 500) -> int:
    """Steps from now until ``rid`` has its first token (the engine runs everything else meanwhile)."""
    for k in range(1, limit + 1):
        engine.step()
        if engine.sequences(rid)[0].output_token_ids:
            return k
    raise AssertionError(f"{rid} had no token after {limit} steps")


def _engine(num_blocks: int = 256, max_num_seqs: int = 8) -> Engine:
    return Engine(
        mini(), CacheConfig(num_blocks=num_blocks), SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=128)
    )


def _flooded(engine: Engine, flood: int = 32) -> None:
    """Tenant A queues ``flood`` requests of n=4 and runs a few steps: every seat (or block) is A's."""
    for k in range(flood):
        engine.add_request(_ids(k, 20), FLOOD, tenant="A")
    for _ in range(3):
        engine.step()


@pytest.mark.parametrize(
    "bound",
    [
        pytest.param({"max_num_seqs": 8}, id="seats"),
        # 24 blocks of 16: A's sequences of 60 tokens take them all, B's prompt finds none free.
        pytest.param({"num_blocks": 24, "max_num_seqs": 64}, id="blocks"),
    ],
)
def test_a_flood_from_one_tenant_keeps_anothers_ttft_within_2x_of_alone(bound: dict[str, Any]) -> None:
    alone = _engine(**bound)
    rid = alone.add_request(_ids(99, 12), SINGLE, tenant="B")
    ttft_alone = _ttft_steps(alone, rid)

    flooded = _engine(**bound)
    _flooded(flooded)
    stats = flooded.stats()
    assert stats.num_requests_waiting > 0  # A is queued past what the engine holds: no seat or no block is free
    assert stats.num_requests_running == bound["max_num_seqs"] or stats.num_free_blocks < 2
    rid = flooded.add_request(_ids(99, 12), SINGLE, tenant="B")
    ttft = _ttft_steps(flooded, rid)
    assert ttft <= 2 * ttft_alone, f"B's first token after {ttft} steps under A's flood, {ttft_alone} alone"

    # Fairness costs A recomputation, never correctness: every sequence still equals the oracle.
    while flooded.has_unfinished_requests():
        flooded.step()
        check_invariants(flooded.kv)
    assert flooded.stats().num_preemptions >= 1
    assert check_against_oracle("mini", tuple(_ids(99, 12)), 4, tuple(flooded.sequences(rid)[0].output_token_ids))
    for k in range(32):
        for seq in flooded.sequences(str(k)):
            assert check_against_oracle("mini", tuple(_ids(k, 20)), 40, tuple(seq.output_token_ids))


def test_without_the_fair_share_a_late_tenant_would_wait_for_the_flood() -> None:
    """The teeth of the test above: within one tenant (FCFS, no preemption) the same single request waits
    for the whole queue ahead of it."""
    engine = _engine()
    _flooded(engine)
    rid = engine.add_request(_ids(99, 12), SINGLE, tenant="A")
    assert _ttft_steps(engine, rid, limit=2000) > 30


def test_one_tenant_is_first_come_first_served_and_never_preempted_for_fairness() -> None:
    engine = _engine(max_num_seqs=4)
    rids = [
        engine.add_request(_ids(k, 10), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for k in range(8)
    ]
    firsts: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        engine.step()
        for rid in rids:
            if rid not in firsts and engine.sequences(rid)[0].output_token_ids:
                firsts[rid] = step
    assert [firsts[r] for r in rids] == sorted(firsts[r] for r in rids)  # admitted in arrival order
    assert engine.stats().num_preemptions == 0


def test_tenants_with_equal_work_take_turns() -> None:
    """Admission goes to the tenant running fewer sequences: two tenants that queued 6 requests each, A's all
    first, run 2 and 2 at a time rather than A's 4 first."""
    engine = _engine(max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for tenant in "AB":
        for k in range(6):
            engine.add_request(_ids(k, 10), params, request_id=f"{tenant}{k}", tenant=tenant)
    engine.step()
    running = sorted(r.tenant or "" for r in engine.scheduler.running)
    assert running == ["A", "A", "B", "B"]


class _CountingTokenizer:
    """The mini tokenizer, counting decode calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.decodes = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decodes += 1
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("tokens", [32, 128])
def test_logprobs_decode_each_token_once(tokens: int) -> None:
    """Each step decodes its own k + 1 entries once and the output text once: O(N) decode calls for N tokens
    (every earlier step's entries were decoded again on every step before: ~N^2 / 2 * (k + 1) calls)."""
    k = 5
    tok = _CountingTokenizer(mini().tokenizer)
    engine = Engine(dataclasses.replace(mini(), tokenizer=tok))
    params = SamplingParams(temperature=1, seed=1, max_tokens=tokens, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    prompt = _ids(7, 16)
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    # Per token: its k + 1 entries and one decode of the output text; per prompt token: k + 1 entries.
    assert tok.decodes <= tokens * (k + 2) + len(prompt) * (k + 1)
    final = outs[-1].outputs[0]
    assert final.logprobs is not None and len(final.logprobs) == tokens
    for tid, step in zip(final.token_ids, final.logprobs, strict=True):
        assert step[tid].decoded_token == mini().tokenizer.decode([tid])
    assert engine.output(rid).prompt_logprobs is not None


def test_a_logprobs_request_beside_a_normal_one_leaves_its_step_count_unchanged() -> None:
    """The normal request takes the same steps beside a logprobs=20 neighbour, and the engine thread's work for
    the neighbour stays flat per step: its 21 entries and its text once each (every earlier step's entries were
    decoded again on every step before: 21 x 1..8 decodes over these 8 steps)."""

    def run(with_neighbour: bool) -> tuple[int, int]:
        tok = _CountingTokenizer(mini().tokenizer)
        engine = Engine(
            dataclasses.replace(mini(), tokenizer=tok),
            CacheConfig(num_blocks=256),
            SchedulerConfig(max_num_seqs=8, max_model_len=128),
        )
        if with_neighbour:
            params = SamplingParams(temperature=1, seed=1, max_tokens=100, ignore_eos=True, logprobs=20)
            engine.add_request(_ids(1, 8), params)
        rid = engine.add_request(_ids(2, 8), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        steps = 0
        while not engine.is_finished(rid):
            engine.step()
            steps += 1
        return steps, tok.decodes

    alone_steps, alone_decodes = run(False)
    steps, decodes = run(True)
    assert steps == alone_steps
    assert decodes - alone_decodes <= steps * (21 + 1)


def _record_preemptions(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(step, request id) of every preemption, as the scheduler makes it."""
    seen: list[tuple[int, str]] = []
    real = engine.scheduler.preempt

    def preempt(req: Any, requeue: bool = True) -> None:
        seen.append((engine.scheduler.step, req.request_id))
        real(req, requeue)

    monkeypatch.setattr(engine.scheduler, "preempt", preempt)
    return seen


def _dry_pool(tenants: list[str | None]) -> Engine:
    """One 6-token prompt per entry of ``tenants`` (two blocks of 4 each), in a pool of 10 blocks: all are admitted
    at once, and the step where each needs its third block finds only two free."""
    engine = Engine(
        mini(),
        CacheConfig(block_size=4, num_blocks=10, share_prefix=False),
        SchedulerConfig(max_num_seqs=8, max_model_len=32),
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for k, tenant in enumerate(tenants):
        engine.add_request(_ids(100 + k, 6), params, request_id=f"{tenant or 'r'}{k}", tenant=tenant)
    return engine


def _run_all(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_a_dry_pool_preempts_the_newest_sequence_of_the_busiest_tenant(monkeypatch) -> None:
    """A runs three sequences, B one (admitted A0, B1, A2, A3: the tenant running fewer goes first). When the pool
    runs dry (each needs its third block, two are free) the victim is A's newest, A3 (not the oldest running, not
    B's only one); at the fourth blocks A still runs two to B's one, so A2 goes next (in the step where A0 and B1
    finish). Each is recomputed later from the front of A's queue, and every output equals the dense oracle."""
    engine = _dry_pool(["A", "B", "A", "A"])
    preempted = _record_preemptions(engine, monkeypatch)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["A0", "B1", "A2", "A3"]
    _run_all(engine)
    assert preempted == [(4, "A3"), (8, "A2")]  # steps 4 and 8: the third and the fourth block of 6 + 8 tokens
    for rid in ("A0", "B1", "A2", "A3"):
        out = engine.output(rid)
        assert check_against_oracle("mini", tuple(out.prompt_token_ids), 8, tuple(out.token_ids)), rid


def test_with_one_tenant_the_most_recently_admitted_is_preempted(monkeypatch) -> None:
    engine = _dry_pool([None, None, None, None])
    preempted = _record_preemptions(engine, monkeypatch)
    _run_all(engine)
    assert preempted == [(4, "r3"), (8, "r2")]


def test_without_chunking_a_prompt_of_exactly_the_budget_is_admitted() -> None:
    """enable_chunked_prefill=False: the whole uncached prompt must fit what is left of the step's token budget;
    one that equals it fits. A decoding request takes 1 of the 32 tokens, so a 31-token prompt is admitted beside
    it in the same step; a 32-token one would wait (it cannot be: max_model_len is 32)."""
    engine = Engine(
        mini(),
        CacheConfig(num_blocks=64),
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False),
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    running = engine.add_request(_ids(6, 4), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    rid = engine.add_request(_ids(7, 31), params)
    engine.step()
    assert engine.sequences(rid)[0].num_computed_tokens == 31 and engine.is_finished(rid)
    assert not engine.is_finished(running)
