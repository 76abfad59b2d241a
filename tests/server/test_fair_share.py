"""No request may buy the engine (the server's side): work is bounded per request and per tenant, with errors
that name the limit, and the scheduler's fair share reaches the engine through the API key's tenant. Steps and
counts are asserted, never seconds."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from test_hardening import NORMAL, Gate, InFlight, expect_error, in_engine, wait_until

from kvlab import LLM, SamplingParams
from server.server_http import TIMEOUT, Http

KEYS = {"ka": "a", "kb": "b"}


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8)
    return [o.token_ids for o in LLM("mini").generate(NORMAL, params, use_tqdm=False)]


def _ask(http: Http, i: int, key: str | None = None, **extra: Any) -> tuple[int, Any]:
    body = {"model": "mini", "prompt": NORMAL[i], "max_tokens": 8, "temperature": 0, **extra}
    return http.post("/v1/completions", body, {"Authorization": f"Bearer {key}"} if key else None)


def test_a_small_body_asking_for_thousands_of_sequences_is_a_400_naming_the_limit(
    make_server, monkeypatch, expected
) -> None:
    srv, http = make_server()
    inflight = InFlight(srv, http, Gate(srv, monkeypatch), expected)
    # 256 prompts x n=64: a 2 KB body that would have queued 16,384 sequences.
    body = {"model": "mini", "prompt": ["x"] * 256, "n": 64, "max_tokens": 16, "temperature": 1}
    err = expect_error(http.post("/v1/completions", body), 400)
    # 256 prompts are over the limit (64 seats) at any n: the field named is the prompt.
    assert err["param"] == "prompt" and "16384 sequences" in err["message"] and "--max-request-seqs" in err["message"]
    chat = {"model": "mini", "messages": [{"role": "user", "content": "hi"}], "n": 65}
    assert expect_error(http.post("/v1/chat/completions", chat), 400)["param"] == "n"
    inflight.check()
    assert srv.loop.num_pending == 0
    # The limit is the operator's: raised, the same shape of request is served.
    _, roomy = make_server(max_request_seqs=6)
    status, answer = roomy.post("/v1/completions", {**body, "prompt": ["x"] * 3, "n": 2, "max_tokens": 2})
    assert status == 200 and len(answer["choices"]) == 6


def test_a_tenant_past_its_share_of_sequences_gets_429_and_other_tenants_are_served(
    make_server, monkeypatch, expected
) -> None:
    srv, http = make_server(api_keys=KEYS, max_tenant_seqs=2)
    gate = Gate(srv, monkeypatch)
    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(_ask, http, i, "ka") for i in (0, 1)]
        wait_until(lambda: in_engine(srv) == 2, "tenant a's two requests to be admitted")
        err = expect_error(_ask(http, 2, "ka"), 429)
        assert err["code"] == "tenant_limit" and "--max-tenant-seqs" in err["message"]
        assert "2 sequences in flight" in err["message"]  # its own numbers, nothing about anyone else
        # n counts: one request of n=2 from tenant b fits its own share, one of n=3 never does.
        assert expect_error(_ask(http, 3, "kb", n=3, temperature=1), 429)["code"] == "tenant_limit"
        other = pool.submit(_ask, http, 3, "kb")
        wait_until(lambda: in_engine(srv) == 3, "tenant b's request to be admitted beside a's")
        gate.open()
        for i, fut in zip((0, 1, 3), [*held, other], strict=True):
            status, body = fut.result(TIMEOUT)
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == expected[i]
    wait_until(lambda: srv.loop.num_pending == 0, "every request to be released")
    status, body = _ask(http, 2, "ka")  # its share is back once its requests are done
    assert status == 200 and body["choices"][0]["token_ids"] == expected[2]


def test_a_tenant_holding_every_seat_gives_one_up_to_another_tenants_request(make_server, expected) -> None:
    """Two streams of tenant a hold both seats for 200 steps; tenant b's request is answered within a few
    steps (one of a's sequences is preempted and recomputed later), not after a's 200."""
    srv, http = make_server(api_keys=KEYS, scheduler={"max_num_seqs": 2})
    flood = {"model": "mini", "prompt": "a long story", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    streams = [http.open_stream(flood, headers={"Authorization": "Bearer ka"}) for _ in range(2)]
    try:
        start = srv.loop.stats.steps
        status, body = _ask(http, 4, "kb")
        assert status == 200 and body["choices"][0]["token_ids"] == expected[4]
        assert srv.loop.stats.steps - start < 50, "b waited for a's streams"
        assert srv.loop.stats.num_preemptions >= 1
    finally:
        for sock in streams:
            sock.close()
