"""``LLM.reset_prefix_cache()`` as vLLM's: every cached prefix forgotten, True; refused (False, nothing changed)
while a request holds blocks; with ``reset_running_requests`` the running requests are preempted first and
finish with the tokens they would have had."""

from __future__ import annotations

from kvlab import LLM, SamplingParams

PROMPT = list(range(40, 40 + 48))  # three full blocks of 16 byte tokens
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _llm() -> LLM:
    return LLM("mini", block_size=16, num_blocks=64, enable_prefix_caching=True)


def test_reset_forgets_every_cached_prefix() -> None:
    llm = _llm()
    first = llm.generate([PROMPT], GREEDY)[0]
    again = llm.generate([PROMPT], GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == len(PROMPT) - 1  # the last one is computed
    assert llm.engine.kv.num_evictable_blocks() > 0
    assert llm.reset_prefix_cache() is True
    assert llm.engine.kv.num_evictable_blocks() == 0
    after = llm.generate([PROMPT], GREEDY)[0]
    assert after.num_cached_tokens == 0
    assert after.token_ids == first.token_ids == again.token_ids
    assert llm.reset_prefix_cache() is True  # nothing cached: still a success, as vLLM's


def test_reset_refused_while_a_request_holds_blocks() -> None:
    llm = _llm()
    llm.generate([PROMPT], GREEDY)
    eng = llm.engine
    rid = eng.add_request(PROMPT[:20] + [7, 8, 9], SamplingParams(temperature=0, max_tokens=4))
    eng.advance()  # admitted: its table holds blocks (one of them the cached prefix it shares)
    evictable = eng.kv.num_evictable_blocks()
    assert llm.reset_prefix_cache() is False
    assert eng.kv.num_evictable_blocks() == evictable  # nothing changed
    while eng.has_unfinished_requests():
        eng.advance()
    assert eng.output(rid).finished
    assert llm.reset_prefix_cache() is True
    assert llm.generate([PROMPT], GREEDY)[0].num_cached_tokens == 0


def test_reset_running_requests_preempts_them_first() -> None:
    llm = _llm()
    alone = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    eng = llm.engine
    rid = eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    eng.advance()
    eng.advance()
    assert eng.kv.has_request(rid)
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert not eng.kv.has_request(rid) and eng.kv.num_evictable_blocks() == 0
    while eng.has_unfinished_requests():
        eng.advance()
    out = eng.output(rid)
    assert out.token_ids == alone.token_ids  # recomputed from scratch, same greedy tokens
