"""A request that once killed the engine thread, and what the server does if the loop ever dies."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from kvlab import LLM, SamplingParams

PROMPTS = [f"The passphrase of client {i} is {w}" for i, w in enumerate(["amber", "jade", "onyx", "coral"] * 5)]


def test_tiny_temperature_and_top_p_do_not_kill_the_engine(http) -> None:
    """Regression: temperature <= 1e-40 or top_p ~ 1e-46 made the probabilities NaN; the sampler raised in
    the engine thread, every in-flight request failed and /health stayed 503 until a restart."""
    expected = [o.token_ids for o in LLM("mini").generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))]
    killers = [{"temperature": 1e-40}, {"temperature": 1e-45, "top_p": 1e-46}, {"temperature": 0.7, "top_p": 1e-46}]

    def ask(i: int) -> tuple[int, dict]:
        body = {"model": "mini", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8, "temperature": 0}
        if i >= len(PROMPTS):
            body.update(killers[i % len(killers)])
        return http.post("/v1/completions", body)

    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(ask, range(2 * len(PROMPTS))))
    assert all(status == 200 for status, _ in answers), [b for s, b in answers if s != 200][:3]
    for i, (_, body) in enumerate(answers[: len(PROMPTS)]):
        assert body["choices"][0]["token_ids"] == expected[i]
    assert http.get("/health")[0] == 200


def test_a_dead_engine_loop_fails_fast_and_reports_it(make_server, monkeypatch) -> None:
    srv, http = make_server()
    status, _ = http.post("/v1/completions", {"model": "mini", "prompt": "warm up", "max_tokens": 2})
    assert status == 200
    died = threading.Event()  # the owner is told after the clients are, so wait for it (a bound, not a timing)
    srv.loop.on_death.append(lambda exc: died.set())

    def broken_step() -> list:
        raise RuntimeError("an engine bug")

    monkeypatch.setattr(srv.engine, "step", broken_step)
    status, body = http.post("/v1/completions", {"model": "mini", "prompt": "this one meets the bug"})
    assert status == 503 and "engine" in body["error"]["message"]
    assert "an engine bug" not in body["error"]["message"]  # no internal text to clients
    assert died.wait(60)
    assert http.get("/health")[0] == 503
    status, body = http.post("/v1/completions", {"model": "mini", "prompt": "after death"})
    assert status == 503


def test_the_foreground_server_exits_non_zero_when_the_engine_loop_dies(monkeypatch) -> None:
    from kvlab.server.serve import ServerConfig, build_app, listen, serve_until_stopped, url
    from server.server_http import Http

    app = build_app(ServerConfig(port=0))
    sock = listen("127.0.0.1", 0)
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(serve_until_stopped(app, sock)), daemon=True)
    runner.start()
    http = Http(url("127.0.0.1", sock.getsockname()[1]))
    while http.get("/health")[0] != 200:
        threading.Event().wait(0.05)

    def broken_step() -> list:
        raise RuntimeError("an engine bug")

    monkeypatch.setattr(app.state.engine_loop.engine, "step", broken_step)
    assert http.post("/v1/completions", {"model": "mini", "prompt": "boom"})[0] == 503
    runner.join(60)
    assert result == [1]  # a supervisor sees the failure and restarts the server
