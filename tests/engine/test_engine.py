from __future__ import annotations

import random

import pytest

from kvlab import LLM, ConfigError, Engine, InvalidRequestError, SamplingParams
from kvlab.attention.varlen import CuSeqlensError, build_cu_seqlens, check_cu_seqlens
from kvlab.config import CacheConfig, SchedulerConfig, admission_blocks
from kvlab.kv import check_invariants
from oracle_cache import mini, oracle

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def test_second_request_with_same_64_token_prefix_hits_at_least_48_tokens() -> None:
    rng = random.Random(0)
    prefix = rand_ids(rng, 64)
    llm = LLM(mini(), block_size=16)
    first = llm.generate([prefix + rand_ids(rng, 5)], GREEDY)[0]
    second = llm.generate([prefix + rand_ids(rng, 7)], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 48
    stats = llm.stats()
    assert stats.prefix_cache_hits == second.num_cached_tokens
    assert stats.prefix_cache_queries == 69 + 71
    assert stats.kv_cache_usage_perc == 0.0  # everything freed


def test_prefix_caching_off_never_hits() -> None:
    rng = random.Random(0)
    prefix = rand_ids(rng, 64)
    llm = LLM(mini(), share_prefix=False)
    llm.generate([prefix + [1]], GREEDY)
    assert llm.generate([prefix + [2]], GREEDY)[0].num_cached_tokens == 0


def test_bad_requests_rejected_while_batch_finishes_correctly() -> None:
    rng = random.Random(1)
    good = [rand_ids(rng, rng.randint(3, 40)) for _ in range(4)]
    llm = LLM(mini(), num_blocks=16, block_size=8, max_model_len=100)
    prompts = [good[0], [], good[1], [5, 300, 7], good[2], rand_ids(rng, 101), [7, -1], good[3]]
    params = [GREEDY] * len(prompts)
    outs = llm.generate(prompts, params)
    errors = {i: o.error for i, o in enumerate(outs) if o.error}
    assert set(errors) == {1, 3, 5, 6}
    assert "empty" in errors[1]
    assert "token id 300 at prompt position 1 is outside the vocabulary [0, 259)" in errors[3]
    assert "101 tokens, more than max_model_len=100" in errors[5]
    assert "token id -1" in errors[6]
    for i in (0, 2, 4, 7):
        assert tuple(outs[i].token_ids) == oracle("mini", tuple(prompts[i]), 8)
        assert outs[i].finish_reason == "length"


def test_request_that_can_never_fit_the_pool_is_rejected() -> None:
    eng = Engine(mini(), CacheConfig(block_size=4, num_blocks=6), SchedulerConfig(max_model_len=128))
    ok = eng.add_request([1, 2, 3], GREEDY)
    with pytest.raises(InvalidRequestError, match="pool has only 6"):
        eng.add_request(list(range(40)), GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
    assert tuple(eng.output(ok).token_ids) == oracle("mini", (1, 2, 3), 8)


@pytest.mark.parametrize("n", [1, 3])
def test_a_pool_of_exactly_the_admission_bound_admits_and_finishes_one_fewer_refuses(n: int) -> None:
    """config.admission_blocks is the engine's rule: n sequences of prompt + max_tokens, each with its blocks and
    one for a shared partial block's copy. A pool of exactly that many blocks runs the request to the oracle's
    tokens (the children fork the prompt's partial block and copy it on their first write), one block fewer is
    refused before it is queued."""
    prompt, max_tokens, bs = (9, 8, 7, 6, 5, 4, 3, 2, 1, 7), 9, 4
    blocks = admission_blocks(len(prompt) + max_tokens, bs, n)
    assert blocks == n * (5 + 1)  # 19 tokens in blocks of 4: 5 blocks, and the copy's
    params = SamplingParams(temperature=0, n=n, max_tokens=max_tokens, ignore_eos=True)
    exact = Engine(mini(), CacheConfig(block_size=bs, num_blocks=blocks), SchedulerConfig(max_model_len=64))
    rid = exact.add_request(list(prompt), params)
    while exact.has_unfinished_requests():
        exact.step()
    assert [tuple(c.token_ids) for c in exact.output(rid).outputs] == [oracle("mini", prompt, max_tokens)] * n
    short = Engine(mini(), CacheConfig(block_size=bs, num_blocks=blocks - 1), SchedulerConfig(max_model_len=64))
    with pytest.raises(InvalidRequestError, match=f"needs up to {blocks} blocks"):
        short.add_request(list(prompt), params)


def test_in_flight_requests_unharmed_by_rejections_mid_stream() -> None:
    eng = Engine(mini(), CacheConfig(sanitize=True), SchedulerConfig(max_model_len=64))
    a = eng.add_request([10, 20, 30, 40], GREEDY)
    eng.step()
    eng.step()
    for bad in ([], [999], list(range(65))):
        with pytest.raises(InvalidRequestError):
            eng.add_request(bad, GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request([1], GREEDY, request_id=a)
    b = eng.add_request([10, 20, 31], GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
    assert tuple(eng.output(a).token_ids) == oracle("mini", (10, 20, 30, 40), 8)
    assert tuple(eng.output(b).token_ids) == oracle("mini", (10, 20, 31), 8)
    assert eng.violations == []


def test_sampling_params_validation_messages() -> None:
    with pytest.raises(InvalidRequestError, match=r"max_tokens must be None or an int >= 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match=r"temperature must be a finite number >= 0"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(InvalidRequestError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match=r"n must be an int >= 1"):
        SamplingParams(n=0)


def test_max_model_len_must_fit_position_embeddings() -> None:
    with pytest.raises(ConfigError, match="max_model_len must be <= the model's max_position_embeddings=512"):
        LLM(mini(), max_model_len=1024, num_blocks=128)


def test_unknown_knob_is_named() -> None:
    with pytest.raises(TypeError, match=r"unknown engine knob\(s\) \['blocksize'\]"):
        LLM(mini(), blocksize=8)


def test_unsafe_knobs_refused_without_unsafe() -> None:
    with pytest.raises(ConfigError, match="unsafe=True"):
        LLM(mini(), copy_on_write=False)
    with pytest.raises(ConfigError, match="unsafe=True"):
        LLM(mini(), filter_empty=False)


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = LLM(mini()).generate([prompt], p)[0].token_ids
    rng = random.Random(2)
    others = [rand_ids(rng, 12) for _ in range(5)]
    crowd = LLM(mini()).generate([*others, prompt], [SamplingParams(temperature=1.0, max_tokens=12)] * 5 + [p])
    assert crowd[-1].token_ids == alone
    other_seed = LLM(mini()).generate([prompt], SamplingParams(temperature=0.9, seed=99, max_tokens=12))[0]
    assert other_seed.token_ids != alone


def test_parallel_sampling_children_share_prompt_blocks_then_diverge() -> None:
    prompt = list(range(40, 80))  # 40 tokens: 2 full blocks of 16 and a partial one
    eng = Engine(mini(), CacheConfig(block_size=16, sanitize=True), SchedulerConfig(max_model_len=128))
    rid = eng.add_request(prompt, SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=10, ignore_eos=True))
    eng.step()  # prefill + fork + first sampled token
    group = eng.sequences(rid)
    assert len(group) == 4
    tables = [eng.kv.block_table(r.request_id) for r in group]
    assert all(t == tables[0] for t in tables)
    assert [eng.kv.refcount(b) for b in tables[0]] == [4, 4, 4]
    while eng.has_unfinished_requests():
        eng.step()
        check_invariants(eng.kv)
    out = eng.output(rid)
    assert len(out.outputs) == 4
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # they diverge after sampling
    assert eng.stats().cow_copies >= 3  # each but the last writer copies the shared partial block
    assert eng.violations == []
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks


def test_parallel_greedy_children_equal_the_oracle() -> None:
    prompt = (9, 8, 7, 6, 5, 4, 3, 2, 1)
    out = LLM(mini()).generate([list(prompt)], SamplingParams(temperature=0, n=3, max_tokens=6, ignore_eos=True))[0]
    assert [tuple(c.token_ids) for c in out.outputs] == [oracle("mini", prompt, 6)] * 3


def test_abort_frees_everything_and_others_finish() -> None:
    eng = Engine(mini(), CacheConfig(block_size=4, num_blocks=64, sanitize=True), SchedulerConfig(max_model_len=128))
    a = eng.add_request(list(range(30)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    b = eng.add_request(list(range(30)) + [1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.abort(a)
    assert not eng.abort(a)
    assert eng.output(a).finish_reason == "abort"
    check_invariants(eng.kv)
    while eng.has_unfinished_requests():
        eng.step()
    assert tuple(eng.output(b).token_ids) == oracle("mini", (*range(30), 1), 5)
    assert eng.kv.usage() == 0.0


def test_stop_tokens_and_eos_finish_with_stop() -> None:
    prompt = (11, 22, 33)
    ref = oracle("mini", prompt, 8)
    stop_at = ref[3]
    out = LLM(mini()).generate([list(prompt)], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))[0]
    assert tuple(out.token_ids) == ref[: ref.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def test_max_tokens_none_fills_the_context_and_too_many_is_an_error() -> None:
    llm = LLM(mini(), max_model_len=12)
    out = llm.generate([list(range(10))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"
    # vLLM's rule: a prompt plus max_tokens beyond the context is refused, not silently cut.
    bad = llm.generate([list(range(10))], SamplingParams(temperature=0, max_tokens=50))[0]
    assert bad.finish_reason == "error" and "maximum context length is 12" in (bad.error or "")


def test_streaming_step_reports_progress_and_metrics() -> None:
    eng = Engine(mini())
    rid = eng.add_request("hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seen = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.append(len(out.token_ids))
    assert seen == [1, 2, 3]
    m = eng.output(rid).metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert eng.output(rid).text == mini().tokenizer.decode(eng.output(rid).token_ids)


def test_cu_seqlens_checks() -> None:
    assert build_cu_seqlens([3, 1, 2]) == [0, 3, 4, 6]
    check_cu_seqlens([0, 3, 4, 6], 6)
    with pytest.raises(CuSeqlensError, match="zero tokens"):
        check_cu_seqlens([0, 3, 3, 6], 6)
    check_cu_seqlens([0, 3, 3, 6], 6, allow_empty=True)
    with pytest.raises(CuSeqlensError, match="non-decreasing"):
        check_cu_seqlens([0, 3, 2], 2)
    with pytest.raises(CuSeqlensError, match="must equal the total"):
        check_cu_seqlens([0, 3, 4], 5)
    with pytest.raises(CuSeqlensError, match="length batch"):
        check_cu_seqlens([0], 0)


def test_generate_accepts_text_and_reports_text() -> None:
    llm = LLM(mini())
    out = llm.generate("请把以下内容翻译成英文：今天天气很好", SamplingParams(temperature=0, max_tokens=4))[0]
    ids = tuple(mini().tokenizer.encode("请把以下内容翻译成英文：今天天气很好"))
    assert tuple(out.token_ids) == oracle("mini", ids, 4)[: len(out.token_ids)]
    assert out.prompt == "请把以下内容翻译成英文：今天天气很好"


def test_advance_moves_like_step_without_building_outputs() -> None:
    a, b = Engine(mini()), Engine(mini())
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for eng in (a, b):
        eng.add_request([4, 5, 6], p, request_id="r")
    moved = []
    while a.has_unfinished_requests():
        moved.append(a.advance())
        assert [o.request_id for o in b.step()] == moved[-1]
    assert moved == [["r"]] * 4
    assert a.is_finished("r") and a.output("r").token_ids == b.output("r").token_ids


def test_requests_sharing_a_prefix_wait_one_step_then_all_hit_it() -> None:
    """The first request computes the shared prefix; the others wait exactly one step (not one each),
    then all join in the same step and find it in the cache."""
    rng = random.Random(5)
    shared = rand_ids(rng, 48)  # 3 blocks of 16
    prompts = [shared + rand_ids(rng, rng.randint(3, 20)) for _ in range(8)]
    eng = Engine(mini(), CacheConfig(block_size=16, num_blocks=128))
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [eng.add_request(pr, p) for pr in prompts]
    assert eng.advance() == [ids[0]]
    assert eng.advance() == ids
    assert all(eng.sequences(i)[0].num_cached_tokens == 48 for i in ids[1:])
    while eng.has_unfinished_requests():
        eng.advance()
    for i, pr in zip(ids, prompts, strict=True):
        assert tuple(eng.output(i).token_ids) == oracle("mini", tuple(pr), 4)


def test_requests_with_a_cached_prefix_do_not_wait_for_each_other() -> None:
    rng = random.Random(6)
    shared = rand_ids(rng, 48)
    eng = Engine(mini(), CacheConfig(block_size=16, num_blocks=128))
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = eng.add_request(shared + [1, 2, 3], p)
    while eng.has_unfinished_requests():
        eng.advance()
    # The prefix is cached now; these differ only after it, so none computes a block another needs.
    ids = [eng.add_request(shared + rand_ids(rng, 10), p) for _ in range(4)]
    assert eng.advance() == ids
    assert first not in ids


def test_a_step_may_batch_more_tokens_than_the_model_has_positions() -> None:
    """The founding document warns that max_num_batched_tokens must stay below max_position_embeddings or
    RoPE goes out of range. Positions are per sequence, so the bound is max_model_len: one 1200-token step of
    four 300-token prompts on the 512-position mini model gives every prompt the oracle's tokens."""
    prompts = [rand_ids(random.Random(k), 300) for k in range(4)]
    engine = Engine(
        mini(),
        CacheConfig(num_blocks=96),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1200, max_model_len=320),
    )
    assert engine.loaded.config.max_position_embeddings == 512
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()  # every prompt whole in the first step: 1200 tokens at positions 0..299 each
    assert engine.stats().steps == 1 and all(len(engine.sequences(r)[0].output_token_ids) == 1 for r in rids)
    while engine.has_unfinished_requests():
        engine.step()
    for p, rid in zip(prompts, rids, strict=True):
        assert tuple(engine.sequences(rid)[0].output_token_ids) == oracle("mini", tuple(p), GREEDY.max_tokens)


def test_request_metrics_carry_vllm_v1s_names() -> None:
    """RequestOutput.metrics reads as vLLM V1's RequestStateStats (monotonic times; 0.0 where not reached) and
    keeps V0's names; a dry pool's preemptions are counted per request, adding up to the scheduler's."""
    eng = Engine(mini(), CacheConfig(block_size=4, num_blocks=12), SchedulerConfig(max_model_len=64))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [eng.add_request(list(range(1 + k, 11 + k)), params) for k in range(2)]
    while eng.has_unfinished_requests():
        eng.step()
    outs = [eng.output(i) for i in ids]
    for out in outs:
        m = out.metrics
        assert m.queued_ts == m.arrival_time <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts
        assert m.first_token_ts == m.first_token_time and m.scheduled_ts == m.first_scheduled_time
        assert m.first_token_latency == m.first_token_ts - m.arrival_time > 0
        assert m.num_generation_tokens == len(out.token_ids) == 20 and not m.is_corrupted
        assert tuple(out.token_ids) == oracle("mini", tuple(out.prompt_token_ids), 20)
    assert eng.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == eng.scheduler.num_preemptions
