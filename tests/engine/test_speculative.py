"""Speculative decoding by prompt lookup (vLLM's ``ngram``): greedy tokens identical to the plain run and to the
dense oracle, drafts counted, and the cache invariant it threatens: a rejected draft's K/V, written before the
verification rejects it, is never findable, never shared, never read by another request."""

from __future__ import annotations

import random
from collections.abc import MutableSequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import LLM, Engine, SamplingParams
from kvlab.attention.paged import ReferenceAttentionMetadata
from kvlab.config import CacheConfig, ConfigError, SchedulerConfig, SpeculativeConfig
from kvlab.engine.runner import ModelRunner
from kvlab.engine.speculative import NgramIndex, propose
from kvlab.instrument.sanitizer import FINDABLE
from kvlab.instrument.trace import Trace
from kvlab.kv import check_invariants
from kvlab.model import dense_logits
from oracle_cache import mini, oracle

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)


# -- the drafter ---------------------------------------------------------------------------------------------
def test_the_draft_follows_the_most_recent_occurrence_of_the_longest_suffix() -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3)
    assert propose([1, 2, 3, 4, 1, 2], cfg, 10) == [3, 4, 1]
    assert propose([1, 2, 3, 4, 9, 2, 3, 7, 2, 3], cfg, 10) == [7, 2, 3]  # [2, 3] recurs; the latest wins
    assert propose([7, 2, 3, 8, 1, 2, 3, 9, 1, 2, 3], cfg, 10) == [9, 1, 2]  # n = 3 beats n = 2's later match
    assert propose([1, 2, 3, 1, 2], cfg, 1) == [3]  # the caller's limit
    assert propose([1, 2, 3, 1, 2], cfg, 0) == []
    assert propose([1, 2], cfg, 10) == []
    assert propose([5, 5, 5], cfg, 10) == [5]
    strict = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=3, prompt_lookup_max=3)
    assert propose([1, 2, 3, 4, 9, 2, 3], strict, 10) == []  # only n = 2 recurs, below prompt_lookup_min


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    k=st.integers(1, 5),
    lo=st.integers(1, 3),
    extra=st.integers(0, 2),
    limit=st.integers(0, 8),
)
def test_a_draft_is_what_followed_an_earlier_occurrence_of_the_suffix(
    tokens: list[int], k: int, lo: int, extra: int, limit: int
) -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=lo + extra)
    draft = propose(tokens, cfg, limit)
    assert len(draft) <= min(k, limit)
    matches = [
        (n, end)
        for n in range(lo, min(lo + extra, len(tokens) - 1) + 1)
        for end in range(n - 1, len(tokens) - 1)
        if tokens[end - n + 1 : end + 1] == tokens[len(tokens) - n :]
    ]
    if not matches or min(k, limit) == 0:
        assert draft == []
        return
    _, end = max(matches)  # the longest suffix, then its most recent occurrence
    assert draft == tokens[end + 1 : end + 1 + min(k, limit)]


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    data=st.data(),
    k=st.integers(1, 5),
    lo=st.integers(1, 3),
    extra=st.integers(0, 3),
    limit=st.integers(0, 8),
)
def test_the_engine_s_index_drafts_what_the_reference_drafts_as_tokens_grow(
    tokens: list[int], data: st.DataObject, k: int, lo: int, extra: int, limit: int
) -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=lo + extra)
    prompt_len = data.draw(st.integers(1, len(tokens)))
    prompt, output = tokens[:prompt_len], tokens[prompt_len:]
    index = NgramIndex()
    upto = 0
    while True:  # the output grows by 0..3 tokens between lookups, as verified drafts append several at once
        assert index.propose(prompt, output[:upto], cfg, limit) == propose(prompt + output[:upto], cfg, limit)
        if upto == len(output):
            break
        upto = min(len(output), upto + data.draw(st.integers(0, 3)))


class CountingTokens(MutableSequence[int]):
    """A request's tokens that count every element read, by index or slice; iteration and numpy's conversion of a
    sequence go through ``__getitem__`` too, so a scan cannot hide (a list subclass would let numpy read its array
    directly)."""

    def __init__(self, items: list[int]) -> None:
        self.items, self.reads = list(items), 0

    def __getitem__(self, i: Any) -> Any:
        got = self.items[i]
        self.reads += len(got) if isinstance(i, slice) else 1
        return got

    def __setitem__(self, i: Any, value: Any) -> None:
        self.items[i] = value

    def __delitem__(self, i: Any) -> None:
        del self.items[i]

    def __len__(self) -> int:
        return len(self.items)

    def insert(self, i: int, value: int) -> None:
        self.items.insert(i, value)


def test_a_lookup_reads_as_many_tokens_as_the_last_token_occurs_not_as_the_context_is_long() -> None:
    """docs/speculative.md: the index's lookup costs what the last token's earlier occurrences cost, where ``propose``
    scans the context. Contexts of 2,000 and 8,000 distinct tokens with the last one's value at three earlier places:
    the step's lookup (its tokens appended, then the walk) reads the same few tokens in both; the reference reads
    every token of each."""
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    index_reads, reference_reads = [], []
    for length in (2_000, 8_000):
        context = [100 + i for i in range(length)]
        for pos in (10, length // 2, length - 50, length - 1):
            context[pos] = 7
        index = NgramIndex()
        assert index.propose(context[:-1], [], cfg, 4) == []  # built up to the step before
        index.tokens = counted = CountingTokens(index.tokens)  # type: ignore[assignment]
        assert index.propose(context[:-1], context[-1:], cfg, 4) == context[length - 49 : length - 45]
        index_reads.append(counted.reads)
        reference = CountingTokens(context)
        assert propose(reference, cfg, 4) == context[length - 49 : length - 45]
        reference_reads.append(reference.reads)
    assert index_reads[0] == index_reads[1] <= 1 + 1 + 3 * 2 + 4, index_reads
    assert all(r >= length for r, length in zip(reference_reads, (2_000, 8_000), strict=True)), reference_reads


def test_the_index_refuses_tokens_that_shrank() -> None:
    index = NgramIndex()
    index.propose([1, 2, 3], [4, 5], SPEC, 4)
    with pytest.raises(ValueError, match="shrank from 5 to 4"):
        index.propose([1, 2, 3], [4], SPEC, 4)


def test_speculative_config_takes_vllm_s_dict() -> None:
    assert SpeculativeConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 4}) == SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=5, prompt_lookup_max=5
    )
    one = SpeculativeConfig.from_vllm({"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    other = SpeculativeConfig.from_vllm({"num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (other.prompt_lookup_min, other.prompt_lookup_max) == (2, 2)
    given = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    assert given.to_vllm() == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                               "prompt_lookup_min": 2}  # fmt: skip
    assert SpeculativeConfig.from_vllm(given.to_vllm()) == given
    with pytest.raises(ConfigError, match="needs 'num_speculative_tokens'"):
        SpeculativeConfig.from_vllm({"method": "ngram"})
    with pytest.raises(ConfigError, match=r"keys \['model'\] are not supported"):
        SpeculativeConfig.from_vllm({"method": "eagle", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="method must be one of"):
        SpeculativeConfig.from_vllm({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="prompt_lookup_max must be >= 4"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ConfigError, match="refused unless unsafe=True"):
        SpeculativeConfig(commit_rejected=True)


# -- the engine ----------------------------------------------------------------------------------------------
def repetitive(rng: random.Random, unit: int, times: int, tail: int = 0) -> list[int]:
    base = [rng.randrange(256) for _ in range(unit)]
    return base * times + [rng.randrange(256) for _ in range(tail)]


def run(
    prompts: list[list[int]],
    spec: SpeculativeConfig | None,
    params: list[SamplingParams] | None = None,
    cache: CacheConfig | None = None,
    model: str = "mini",
    budget: int = 2048,
    trace: Trace | None = None,
) -> tuple[list[list[int]], Engine]:
    cache = cache or CacheConfig(block_size=4, num_blocks=160, sanitize=True)
    eng = Engine(
        mini(model), cache, SchedulerConfig(max_model_len=128, speculative=spec, max_num_batched_tokens=budget), trace
    )
    for i, p in enumerate(prompts):
        sp = params[i] if params else SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        eng.add_request(p, sp, request_id=str(i))
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        check_invariants(eng.kv)
        steps += 1
        assert steps < 2000
    assert eng.violations == [], [v.explain() for v in eng.violations[:3]]
    return [list(eng.output(str(i)).outputs[0].token_ids) for i in range(len(prompts))], eng


@pytest.mark.parametrize("model", ["mini", "mini-gqa"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_tokens_are_the_plain_run_s_and_the_oracle_s(model: str, block_size: int) -> None:
    rng = random.Random(block_size)
    prompts = [repetitive(rng, 6, 4), repetitive(rng, 9, 2, 3), repetitive(rng, 20, 1), repetitive(rng, 5, 6)]
    prompts.append(prompts[0][:18] + repetitive(rng, 4, 2))  # shares a cached prefix with the first
    cache = CacheConfig(block_size=block_size, num_blocks=640 // block_size, sanitize=True)
    plain, _ = run(prompts, None, cache=cache, model=model)
    spec, eng = run(prompts, SPEC, cache=cache, model=model)
    assert spec == plain
    for p, toks in zip(prompts, spec, strict=True):
        assert tuple(toks) == oracle(model, tuple(p), 24)
    s = eng.spec_stats
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens <= s.num_draft_tokens
    assert sum(s.num_accepted_tokens_per_pos) == s.num_accepted_tokens
    assert s.num_accepted_tokens_per_pos == sorted(s.num_accepted_tokens_per_pos, reverse=True)


def test_accepted_drafts_save_steps() -> None:
    rng = random.Random(3)
    prompt = repetitive(rng, 5, 6)
    plain, e0 = run([prompt], None)
    spec, e1 = run([prompt], SPEC)
    assert spec == plain
    # One step per token without speculation; each verification step adds its accepted drafts.
    assert e0.scheduler.step == 1 + 24 - 1
    assert e1.scheduler.step == e0.scheduler.step - e1.spec_stats.num_accepted_tokens


def test_sampled_requests_and_stops_inside_a_draft() -> None:
    rng = random.Random(5)
    prompt = repetitive(rng, 6, 4)
    ref = oracle("mini", tuple(prompt), 24)
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),  # never drafted
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=(ref[9],)),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=24, stop_token_ids=(ref[3],)),
    ]
    plain, _ = run([prompt] * 4, None, params)
    spec, eng = run([prompt] * 4, SPEC, params)
    assert spec == plain
    assert spec[1] == list(ref[: ref.index(ref[9]) + 1]) and spec[2] == list(ref[:7])
    assert len(spec[3]) == 24 and ref[3] not in spec[3]  # masked until min_tokens, and min_tokens is all of it
    assert eng.output("2").outputs[0].logprobs is not None and len(eng.output("2").outputs[0].logprobs or []) == 7


@pytest.mark.parametrize("model", ["mini", "mini-gqa"])
def test_every_draft_row_s_logits_are_the_dense_pass_s(model: str) -> None:
    # Each appended token keeps the logits of the row that picked it: a plain row's, or a draft row's, computed with
    # the other drafting requests' rows in one padded batch (DraftRows). Against the dense, no-cache pass at the
    # same position: 1e-4 absolute (fp32; the logits are O(1)).
    rng = random.Random(11)
    prompts = [repetitive(rng, 6, 4), repetitive(rng, 9, 2, 3), repetitive(rng, 5, 6), repetitive(rng, 3, 3)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, return_logits=True)] * len(prompts)
    toks, eng = run(prompts, SPEC, params, model=model)
    assert eng.spec_stats.num_accepted_tokens > 0
    for i, (prompt, out) in enumerate(zip(prompts, toks, strict=True)):
        logits = eng.output(str(i)).outputs[0].logits
        assert logits is not None and len(logits) == len(out)
        dense = dense_logits(mini(model).model, [*prompt, *out[:-1]])[len(prompt) - 1 :]
        assert logits.float().sub(dense).abs().max().item() < 1e-4


def test_drafts_are_attended_in_one_call_a_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference path: a step's single-query rows in one SDPA call a layer, and every drafting request's rows
    # in one more, whatever their count (before, a call for each drafting request, as a prefill segment).
    calls: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(q.shape[0])
        return sdpa(q, *args, **kwargs)

    metas: list[ReferenceAttentionMetadata] = []
    prepare = ModelRunner.prepare

    def recorded(self, batch):  # type: ignore[no-untyped-def]
        prep = prepare(self, batch)
        assert isinstance(prep.meta, ReferenceAttentionMetadata)
        metas.append(prep.meta)
        return prep

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    monkeypatch.setattr(ModelRunner, "prepare", recorded)
    rng = random.Random(3)
    prompts = [repetitive(rng, 5, 6), repetitive(rng, 4, 5), repetitive(rng, 6, 4), repetitive(rng, 3, 7)]
    _, eng = run(prompts, SPEC)
    layers = eng.loaded.config.num_layers
    steps = [m for m in metas if m.drafts is not None and not m.prefills]
    assert steps and max(m.drafts.query_rows.shape[0] for m in steps if m.drafts is not None) >= 2
    assert len(calls) == sum(
        layers * ((m.single_query is not None) + (m.drafts is not None) + len(m.prefills)) for m in metas
    )
    for m in steps:  # every row once: a single-query row or a draft's
        assert m.drafts is not None
        single = [] if m.single_query is None else m.single_query.rows.tolist()
        rows = sorted(single + m.drafts.rows.tolist())
        assert rows == list(range(m.slot_mapping.shape[0]))


def test_min_tokens_ending_inside_a_draft_unmasks_the_stop_there() -> None:
    # Each draft row is sampled with the output its own position has: the stop id masked before min_tokens, not
    # after. This prompt's greedy answer alternates two tokens; one of them stops it, and for the even boundaries
    # a draft holding both crosses min_tokens. The plain run's tokens for every boundary.
    rng = random.Random(2)
    prompt = repetitive(rng, 6, 4)
    ref = oracle("mini", tuple(prompt), 24)
    stop = ref[3]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=m, stop_token_ids=(stop,))
        for m in range(1, 13)
    ]
    plain, _ = run([prompt] * len(params), None, params)
    spec, eng = run([prompt] * len(params), SPEC, params)
    assert spec == plain and eng.spec_stats.num_accepted_tokens > 0
    assert any(toks[-1] == stop and len(toks) > p.min_tokens for toks, p in zip(plain, params, strict=True))


def test_one_sampling_call_a_step_for_every_row_drafts_included(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvlab.engine.engine as engine_module

    calls: list[int] = []

    def counted(logits, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(logits.shape[0])
        return sample(logits, *args, **kwargs)

    sample = engine_module.sample
    monkeypatch.setattr(engine_module, "sample", counted)
    rng = random.Random(3)
    prompts = [repetitive(rng, 5, 6), repetitive(rng, 7, 3), [rng.randrange(256) for _ in range(20)]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2
    params.append(SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True))  # never drafted
    spec, eng = run(prompts, SPEC, params)
    s = eng.spec_stats
    assert s.num_drafts > 0 and len(calls) == eng.scheduler.step
    # Each request's next token, plus its draft's rows where it has one.
    generated = sum(len(t) for t in spec)
    assert sum(calls) == generated - s.num_accepted_tokens + s.num_draft_tokens


def test_a_draft_counts_against_the_token_budget_and_never_preempts() -> None:
    rng = random.Random(7)
    prompts = [repetitive(rng, 4, 5) for _ in range(3)]
    plain, _ = run(prompts, None, budget=64)
    spec, eng = run(prompts, SPEC, budget=64)
    assert spec == plain and eng.spec_stats.num_drafts > 0
    # A pool with room for the prompts and their answers but not always for a draft: drafts give way.
    tight = CacheConfig(block_size=4, num_blocks=3 * 12 + 2, sanitize=True)
    plain, e0 = run(prompts, None, cache=tight)
    spec, e1 = run(prompts, SPEC, cache=tight)
    assert spec == plain and e1.scheduler.num_preemptions <= e0.scheduler.num_preemptions


# -- the invariant: a rejected draft is never findable, shared or read ---------------------------------------
def rejected_draft(trace: Trace, tokens: list[int]) -> tuple[list[int], int] | None:
    """A prompt that ends in a rejected draft token of the traced request (its verified context, the draft up to
    and including the first rejected token, one more token) and the length of the verified context."""
    for e in trace.select(op="draft"):
        draft, accepted, pos = e.detail["draft"], e.detail["accepted"], e.detail["position"]
        if accepted < len(draft):
            return tokens[:pos] + draft[: accepted + 1] + [0], pos + accepted
    return None


def find_rejection(cache: CacheConfig, spec: SpeculativeConfig) -> tuple[Engine, list[int], int]:
    for seed in range(40):
        rng = random.Random(seed)
        prompt = repetitive(rng, 3, 5, 2)
        trace = Trace()
        eng = Engine(mini(), cache, SchedulerConfig(max_model_len=128, speculative=spec), trace)
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), request_id="a")
        while eng.has_unfinished_requests():
            eng.step()
        found = rejected_draft(trace, prompt + eng.output("a").outputs[0].token_ids)
        if found is not None:
            return eng, *found
    raise AssertionError("no rejected draft in 40 prompts")


def test_a_rejected_draft_is_never_found_by_a_later_request() -> None:
    cache = CacheConfig(block_size=4, num_blocks=64, sanitize=True)
    eng, probe, verified = find_rejection(cache, SPEC)
    assert eng.kv.lookup(probe) <= verified, "the index holds the rejected draft token"
    eng.add_request(probe, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id="b")
    while eng.has_unfinished_requests():
        eng.step()
        check_invariants(eng.kv)
    assert eng.violations == []
    assert tuple(eng.output("b").outputs[0].token_ids) == oracle("mini", tuple(probe), 4)


def test_the_unsafe_commit_of_rejected_drafts_is_caught_by_the_sanitizer() -> None:
    cache = CacheConfig(block_size=4, num_blocks=64, sanitize=True)
    unsafe = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, commit_rejected=True, unsafe=True)
    eng, probe, verified = find_rejection(cache, unsafe)
    assert eng.kv.lookup(probe) > verified, "the rejected draft stayed findable"
    offered = [v for v in eng.violations if v.kind == "draft" and v.reader == FINDABLE]
    assert offered and offered[0].writer == "a" and "findable by the prefix index" in offered[0].explain()
    assert len({v.slot for v in offered}) == len(offered), "each offered slot is reported once"
    eng.add_request(probe, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id="b")
    while eng.has_unfinished_requests():
        eng.step()
    kinds = {(v.kind, v.reader, v.writer) for v in eng.violations}
    assert ("draft", "b", "a") in kinds, [v.explain() for v in eng.violations[:3]]
    assert "never verified" in next(v for v in eng.violations if v.kind == "draft").explain()


def test_llm_takes_vllm_s_speculative_config() -> None:
    rng = random.Random(3)
    prompt = repetitive(rng, 5, 6)
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(mini(), speculative_config=config)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert tuple(out.outputs[0].token_ids) == oracle("mini", tuple(prompt), 24)
    stats = llm.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.steps == 24 - stats.spec_decode_num_accepted_tokens


@pytest.mark.parametrize(
    ("budget", "max_model_len", "max_tokens", "binding"),
    [(3, 128, 24, "budget"), (64, 40, None, "context"), (64, 128, 9, "max_tokens")],
)
def test_a_draft_stays_within_the_budget_the_context_and_max_tokens(
    budget: int, max_model_len: int, max_tokens: int | None, binding: str
) -> None:
    """Every draft (the trace's "draft" events): drafted for a greedy decode step only, never for a prompt chunk nor
    a sampled request; the step's token and its draft within the step's budget; its last position inside
    max_model_len; no more tokens than the request may still generate after the step's own. And each case's bound
    binds: some draft reaches it exactly."""
    rng = random.Random(budget + max_model_len + 1)
    # At a budget of 3 the greedy prompt (16 tokens) ends in a 1-token chunk.
    prompts = [repetitive(rng, 4, 4), repetitive(rng, 3, 5)]
    trace = Trace()
    eng = Engine(
        mini(),
        CacheConfig(block_size=4, num_blocks=160, sanitize=True),
        SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=max(budget, 3), speculative=SPEC),
        trace,
    )
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    eng.add_request(prompts[0], greedy, request_id="g")
    eng.add_request(prompts[1], SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True), request_id="s")
    eng.work_log = []
    while eng.has_unfinished_requests():
        eng.step()
    drafts = trace.select(op="draft")
    assert drafts and {e.request for e in drafts} == {"g"}, "only the greedy request drafts"
    room = {"budget": [], "context": [], "max_tokens": []}  # what each bound left each draft
    for e in drafts:
        position, k = e.detail["position"], len(e.detail["draft"])
        out = position - len(prompts[0])  # tokens generated before this step's
        assert out >= 1, "a draft is for a decode step, never a prompt chunk"
        room["budget"].append(budget - 1 - k)
        room["context"].append(max_model_len - position - k)
        if max_tokens is not None:
            room["max_tokens"].append(max_tokens - out - 1 - k)
    assert all(r >= 0 for rs in room.values() for r in rs), room
    assert min(room[binding]) == 0, f"no draft reached the {binding} bound: {room[binding]}"
    assert max(w.query_tokens for w in eng.work_log) <= max(budget, 3)
    assert eng.violations == []
    assert tuple(eng.output("g").outputs[0].token_ids) == oracle(
        "mini", tuple(prompts[0]), max_tokens if max_tokens is not None else max_model_len - len(prompts[0])
    )
