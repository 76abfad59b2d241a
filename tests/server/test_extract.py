"""`kvlab probe --extract`: the prompt-extraction attack, first against a fake prefix cache (the guessing
logic, every verdict), then against live kvlab servers (the regression tests of issue 14, item 3)."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.probe.attacks.base import (
    CALIBRATION_LENGTHS,
    ExtractConfig,
    ExtractReport,
    Reply,
    Step,
    aligned_length,
    chance_of,
    common_prefix,
    decide,
    infer_granularity,
    max_width,
    next_width,
)
from kvlab.probe.attacks.chars import fastest_by_rank, ranks_within
from kvlab.probe.extract import extract, run_extract
from kvlab.probe.metrics import MetricsCheck, hit_counter

# Small secrets keep the live tests short: 5 characters of 4 letters. With the default budget of 256 guesses
# per step, block reporting lets the attacker guess 4 characters jointly (4**4 = 256) at the first block
# boundary, which the simulated victim's prefix is laid out to put 4 characters into the secret.
SMALL = {"alphabet": "abcd", "secret_length": (5, 5)}


# ------------------------------------------------------------------ a fake prefix cache
@dataclass
class FakeCache:
    """kvlab's prefix cache in a few lines: one character = one token; a prompt hits the longest common
    prefix with any earlier prompt of its namespace, at most all but its last token; the report is exact,
    rounded down to blocks, or absent. Latency: ``per_token`` seconds per uncached token plus noise."""

    report: str = "exact"  # exact | block | off
    block: int = 16
    shared: bool = True  # False: every sender is a namespace of its own (per-tenant with distinct keys)
    per_token: float = 0.0
    noise: float = 0.0
    seed: int = 0
    entries: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    counted: int = 0  # every sender's hit tokens, exactly: the /metrics counter of a server that keeps one

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def send(self, who: str, prompt: str) -> Reply:
        ns = "all" if self.shared else who
        hit = min(max((common_prefix(prompt, e) for e in self.entries[ns]), default=0), len(prompt) - 1)
        self.entries[ns].append(prompt)
        self.sent[who] += 1
        self.counted += hit
        cached = {"exact": hit, "block": hit // self.block * self.block, "off": None}[self.report]
        seconds = 0.01 + self.per_token * (len(prompt) - hit) + self.rng.uniform(0, self.noise)
        return Reply(cached, len(prompt), seconds)


@dataclass
class FakeSender:
    cache: FakeCache
    who: str
    silent: bool = False  # a victim that never reaches the server

    def send(self, prompt: str) -> Reply:
        if self.silent:
            return Reply(0, len(prompt), 0.01)
        return self.cache.send(self.who, prompt)


def run_fake(
    cache: FakeCache, silent_victim: bool = False, counter: Callable[[], float | None] | None = None, **kw: object
) -> ExtractReport:
    cfg = ExtractConfig(**{**SMALL, "seed": 3, **kw})  # type: ignore[arg-type]
    return extract(FakeSender(cache, "attacker"), FakeSender(cache, "victim", silent_victim), cfg, counter=counter)


# ------------------------------------------------------------------ pure pieces
def test_infer_granularity() -> None:
    lengths = CALIBRATION_LENGTHS
    for g in (1, 2, 4, 8, 16, 32, 64):
        assert infer_granularity(lengths, [n // g * g for n in lengths]) == g
    assert infer_granularity(lengths, [0] * len(lengths)) is None  # no hit: no channel
    assert infer_granularity(lengths, [None] * len(lengths)) is None  # not reported
    assert infer_granularity(lengths, [n - 1 for n in lengths]) is None  # follows no block size


def test_widths_and_alignment() -> None:
    assert next_width(70, 1) == 1 and next_width(70, 16) == 10 and next_width(64, 16) == 16
    assert max_width(4, 256) == 4 and max_width(16, 256) == 2 and max_width(4, 255) == 3 and max_width(300, 256) == 0
    for base, g, w in ((60, 16, 4), (7, 16, 2), (64, 16, 1), (60, 1, 1), (10, 64, 3)):
        n = aligned_length(base, g, w)
        assert n >= base and n >= g and (n + w) % g == 0 and n - max(base, g) < g


def test_chance_and_verdicts() -> None:
    steps = [Step(0, 2, 16, 5, "recovered", "ab", True), Step(2, 1, 4, 4, "no hit")]
    assert chance_of(steps, 2) == 1 / 16 and chance_of(steps, 0) == 1.0
    report = ExtractReport("", "", "abcd", "abcd", 10, channel="cached_tokens", granularity=1, steps=steps)
    report.recovered, report.correct_chars, report.chance = "ab", 2, 1 / 16
    assert decide(report, 0.01)[0] == "inconclusive"  # right, but a guess is right 1 time in 16
    assert decide(report, 0.1)[0] == "leak"


def test_rank_test() -> None:
    rng = random.Random(0)
    clear = [{"a": 1.0 + j, "b": 2.0 + j, "c": 2.1 + j, "d": 1.9 + j} for j in range(7)]  # drift between repeats
    best, p = fastest_by_rank(clear, rng)
    assert best == "a" and p < 0.001
    noise = [{c: rng.random() for c in "abcd"} for _ in range(7)]
    assert fastest_by_rank(noise, rng)[1] > 0.01
    # Ties (a clock too coarse to tell) pick nobody.
    assert fastest_by_rank([dict.fromkeys("abcd", 1.0)] * 7, rng)[1] == 1.0
    assert ranks_within({"a": 2.0, "b": 1.0, "c": 2.0}) == {"b": 0.0, "a": 1.5, "c": 1.5}


def test_config_is_validated() -> None:
    for bad in ({"alphabet": "a"}, {"alphabet": "aab"}, {"secret": "xyz"}, {"secret_length": (3, 2)}):
        with pytest.raises(ValueError):
            ExtractConfig(**bad).validate()  # type: ignore[arg-type]


# ------------------------------------------------------------------ the attack against the fake cache
def test_exact_reporting_recovers_the_whole_secret() -> None:
    cache = FakeCache("exact")
    r = run_fake(cache)
    assert r.verdict == "leak" and r.recovered == r.secret and r.correct_chars == 5
    assert r.channel == "cached_tokens" and r.granularity == 1 and r.prefix_visible
    # At most every candidate of every position, plus the final step that finds the end of the secret.
    # Calibration: each of its questions after the long prompt is cached again (a one-slot server keeps only
    # the last prompt); then the prefix check and at most 6 steps of 4 candidates.
    assert r.attacker_requests <= 2 * len(CALIBRATION_LENGTHS) + 1 + 6 * 4


def test_block_reporting_recovers_up_to_the_first_block_boundary() -> None:
    r = run_fake(FakeCache("block"))
    assert r.granularity == 16 and r.verdict == "leak"
    assert r.recovered == r.secret[:4] and r.steps[0].width == 4 and r.steps[0].candidates == 256
    assert r.steps[-1].outcome == "unreachable"  # the next boundary is 16 characters on
    assert (r.prefix_chars + 4) % 16 == 0 and r.chance == 1 / 256


def test_block_reporting_with_a_fixed_layout_can_be_unreachable() -> None:
    """A prefix of the user's own that puts the first boundary 10 characters in: 4**10 guesses, too many."""
    r = run_fake(FakeCache("block"), prefix="x" * 70, secret="abcdabcdabcd")
    assert r.steps[0].outcome == "unreachable" and r.verdict == "inconclusive" and not r.recovered


@pytest.mark.parametrize("report", ["exact", "block"])
def test_separate_tenants_leak_nothing(report: str) -> None:
    r = run_fake(FakeCache(report, shared=False))
    assert r.verdict == "no leak" and r.recovered == "" and r.prefix_visible is False
    assert r.steps[0].tried == r.steps[0].candidates


@pytest.mark.parametrize("report", ["exact", "block"])
def test_the_attackers_own_guesses_never_count(report: str) -> None:
    """A shared cache, but the victim never reaches it: every entry is the attacker's own. A hit past the
    known part could then only come from one guess hitting another, and the guesses are built so it cannot."""
    r = run_fake(FakeCache(report), silent_victim=True, secret="aaaaa")
    assert r.verdict == "no leak" and r.recovered == ""


def test_a_channel_that_singles_out_wrong_characters_is_inconclusive() -> None:
    """Separate tenants, but the server claims a hit for every guess ending in 'a': the attacker believes it,
    the probe (which knows the secret) sees the guesses are wrong and concludes nothing."""

    class Liar(FakeCache):
        def send(self, who: str, prompt: str) -> Reply:
            real = super().send(who, prompt)
            return Reply(len(prompt) - 1, real.prompt_tokens, real.seconds) if prompt.endswith("a#") else real

    r = run_fake(Liar("exact", shared=False), secret="ddddd")
    assert r.recovered.startswith("aaaaa") and r.correct_chars == 0
    assert r.verdict == "inconclusive" and "wrong guess" in r.reason


def test_no_report_falls_back_to_ttft() -> None:
    # A noiseless clock: one uncached token costs 1 ms, so each right character shows.
    r = run_fake(FakeCache("off", per_token=0.001))
    assert r.channel == "ttft" and r.verdict == "leak" and r.recovered == r.secret
    assert r.prefix_ttft_auc == 1.0
    # Pure noise: the attack must not conclude anything, least of all safety.
    r = run_fake(FakeCache("off", per_token=0.0, noise=0.01))
    assert r.channel == "ttft" and r.verdict == "inconclusive" and r.correct_chars == 0
    assert any("does not report cached_tokens" in n for n in r.notes)


def test_always_zero_cached_tokens_falls_back_to_ttft() -> None:
    class Zero(FakeCache):
        def send(self, who: str, prompt: str) -> Reply:
            return Reply(0, len(prompt), super().send(who, prompt).seconds)

    r = run_fake(Zero("exact", noise=0.01))
    assert r.channel == "ttft" and r.verdict == "inconclusive"


# ------------------------------------------------------------------ the /metrics hit counter
@pytest.mark.parametrize("report", ["off", "block"])
def test_the_hit_counter_is_read_where_responses_hide_the_hits(report: str) -> None:
    """cached_tokens absent or in blocks, but a counter of every hit token: the attack reads the counter's
    delta around each of its requests, and recovers the whole secret."""
    cache = FakeCache(report)
    r = run_fake(cache, counter=lambda: cache.counted)
    assert r.channel == "metrics" and r.granularity == 1 and r.channel_label.endswith("counter, exact")
    assert r.verdict == "leak" and r.recovered == r.secret and r.prefix_visible
    assert r.calibration["counted"] == list(CALIBRATION_LENGTHS)
    assert any("/metrics counts the hits exactly" in n for n in r.notes), r.notes


def test_the_hit_counter_is_not_preferred_to_an_exact_field_nor_read_when_noisy() -> None:
    cache = FakeCache("exact")
    r = run_fake(cache, counter=lambda: cache.counted)
    assert r.channel == "cached_tokens" and r.granularity == 1  # as fine: the response's own field
    busy = FakeCache("off")
    rng = random.Random(0)
    # Another client's hits land between the reads: deltas follow no block size, so the channel is not used.
    r = run_fake(busy, counter=lambda: busy.counted + rng.randrange(0, 40))
    assert r.channel == "ttft" and r.correct_chars == 0
    separate = FakeCache("off", shared=False)
    r = run_fake(separate, counter=lambda: separate.counted)
    assert r.channel == "metrics" and r.verdict == "no leak" and r.prefix_visible is False


def test_hit_counter_parsing_and_summaries() -> None:
    text = "\n".join(
        [
            "# HELP kvlab:prefix_cache_hits_total Prompt tokens found in the prefix cache",
            "# TYPE kvlab:prefix_cache_hits_total counter",
            'kvlab:prefix_cache_hits_total{model_name="we\\"ird} 9 name"} 40.0',
            'kvlab:prefix_cache_hits_created{model_name="m"} 1.7e9',
            'kvlab:prefix_cache_queries_total{model_name="m"} 100.0',
        ]
    )
    assert hit_counter(text) == ("kvlab:prefix_cache_hits_total", 40.0)
    vllm = 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3\nvllm:prefix_cache_hits_total{engine="1"} 4 17000'
    assert hit_counter(vllm) == ("vllm:prefix_cache_hits_total", 7.0)  # summed over engines; a timestamp ignored
    older = 'vllm:gpu_prefix_cache_hits_total{model_name="m"} 5.0'
    assert hit_counter(older) == ("vllm:gpu_prefix_cache_hits_total", 5.0)
    assert hit_counter("kvlab:prefix_cache_queries_total 3") is None and hit_counter("") is None
    assert [MetricsCheck(s).summary() for s in (401, 403)] == ["not reachable (401)", "not reachable (403)"]
    assert MetricsCheck(404).summary() == "not offered (404)"
    open_ = MetricsCheck(200, "none", "kvlab:prefix_cache_hits_total", 64)
    assert open_.summary().startswith("reachable without a key: reveals cache hits of every request")
    assert "did not move" in MetricsCheck(200, "API key", "kvlab:prefix_cache_hits_total", 0).summary()


# ------------------------------------------------------------------ live kvlab servers
def live(http_url: str, **kw: object) -> ExtractReport:
    keys = {k: kw.pop(k) for k in ("api_key", "victim_api_key", "metrics_api_key") if k in kw}
    cfg = ExtractConfig(**{**SMALL, **kw})  # type: ignore[arg-type]
    report = run_extract(http_url, "mini", cfg, **keys)  # type: ignore[arg-type]
    print(
        f"\n{report.channel_label}: {report.verdict}, recovered {report.recovered!r} of {report.secret!r} "
        f"({report.correct_chars} correct) in {report.attacker_requests} + {report.victim_requests} requests, "
        f"{report.seconds:.1f}s: {report.reason}"
    )
    return report


def test_default_server_leaks_through_block_reports(make_server) -> None:
    """No keys: every client is the one anonymous tenant, so the victim's cache is the attacker's. Block
    reporting hides all but block boundaries; the one within reach (4 characters in) gives the secret away."""
    _, http = make_server()
    r = live(http.base_url)
    assert r.channel == "cached_tokens" and r.granularity == 16 and r.prefix_visible
    assert r.verdict == "leak" and r.recovered == r.secret[:4] and r.correct_chars == 4
    assert r.metrics == "not reachable (401)", "the suite's servers keep /metrics for their metrics key"
    assert r.steps[-1].outcome == "unreachable"


def test_exact_reporting_gives_the_whole_secret(make_server) -> None:
    _, http = make_server(report_cached_tokens="exact")
    r = live(http.base_url)
    assert r.granularity == 1 and r.verdict == "leak" and r.recovered == r.secret
    # Calibration: each of its questions after the long prompt is cached again (a one-slot server keeps only
    # the last prompt); then the prefix check and at most 6 steps of 4 candidates.
    assert r.attacker_requests <= 2 * len(CALIBRATION_LENGTHS) + 1 + 6 * 4


def test_tenants_with_their_own_keys_leak_nothing(make_server) -> None:
    _, http = make_server(api_keys={"victim-key": "victim", "attacker-key": "attacker"}, prefix_sharing="per-tenant")
    r = live(http.base_url, api_key="attacker-key", victim_api_key="victim-key", max_candidates=16)
    assert r.verdict in ("no leak", "inconclusive") and r.correct_chars == 0 and r.recovered == ""
    assert r.prefix_visible is False  # not even the known prefix is shared
    # The positive control on the same server: one key for both, one tenant, the cache is shared.
    same = live(http.base_url, api_key="victim-key", victim_api_key="victim-key")
    assert same.verdict == "leak" and same.correct_chars == 4


def test_reporting_off_closes_the_metrics_channel_by_default(make_server) -> None:
    """Regression (the issue's reproducer, as the probe runs it): cached_tokens off used to leave the hit
    counter of an open /metrics, which gave the secret away. Now /metrics answers 403, and the attack is left
    with TTFT (two repeats: too few to conclude, which keeps the run short)."""
    _, http = make_server(report_cached_tokens="off", metrics_api_key=None)
    r = live(http.base_url, ttft_repeats=2)
    assert r.metrics == "not reachable (403)" and "counted" not in r.calibration
    assert r.channel == "ttft" and r.recovered == "" and r.correct_chars == 0


def test_public_metrics_gives_the_secret_away_through_the_hit_counter(make_server) -> None:
    """The positive control on the same kind of server: the operator opens /metrics to anyone."""
    _, http = make_server(report_cached_tokens="off", public_metrics=True)
    r = live(http.base_url)
    assert r.metrics.startswith("reachable without a key: reveals cache hits of every request")
    assert r.channel == "metrics" and r.granularity == 1 and r.verdict == "leak" and r.recovered == r.secret


def test_an_operator_audits_with_the_metrics_key(make_server) -> None:
    """The default server reports blocks, which stop the attack at the first boundary; the operator's metrics
    key shows what a holder of it could do: every character, through the exact counter."""
    srv, http = make_server()
    r = live(http.base_url, metrics_api_key=srv.cfg.metrics_api_key)
    assert r.metrics.startswith("reachable with the given metrics API key: reveals cache hits of every request")
    assert r.channel == "metrics" and r.granularity == 1 and r.recovered == r.secret and r.verdict == "leak"
    args = ["probe", "--base-url", http.base_url, "--model", "mini", "--extract", "--alphabet", "abcd"]
    res = CliRunner().invoke(app, [*args, "--secret", "dcba", "--metrics-api-key", "wrong", "--json", "-"])
    data = json.loads(res.stdout)  # the JSON alone: the phases went to stderr
    caps = data["capabilities"]
    assert caps["metrics"] == "not reachable (401)" and caps["channel"] == "cached_tokens"
    assert data["evidence"]["metrics"] == data["capabilities"]["metrics"]


def test_no_cached_tokens_falls_back_to_timing(make_server) -> None:
    _, http = make_server(report_cached_tokens="off")
    r = live(http.base_url)
    assert r.channel == "ttft" and r.verdict != "no leak"
    if r.verdict == "leak":  # the clock really told: then what it told must be right
        assert r.correct_chars > 0 and r.chance <= 0.01


def test_cli_extract_json_and_exit_codes(make_server) -> None:
    _, http = make_server(report_cached_tokens="exact")
    args = ["probe", "--base-url", http.base_url, "--model", "mini", "--extract", "--alphabet", "abcd"]
    res = CliRunner().invoke(app, [*args, "--secret", "dcba", "--json", "-"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)  # the JSON alone: the phases went to stderr
    assert data["schema_version"] and data["kind"] and data["exit_code"] == 1
    assert data["verdict"] == "leak" and data["evidence"]["recovered"] == "dcba"
    assert data["capabilities"]["channel"] == "cached_tokens"
    text = CliRunner().invoke(app, [*args, "--secret-length", "4"])
    assert text.exit_code == 1 and "verdict: LEAK" in text.output, text.output
    # Three characters of four letters are guessed right 1 time in 64: not beyond chance (alpha 0.01).
    short = CliRunner().invoke(app, [*args, "--secret", "abc"])
    assert short.exit_code == 0 and "verdict: INCONCLUSIVE" in short.output, short.output
    bad = CliRunner().invoke(app, [*args, "--secret", "xyz"])
    assert bad.exit_code == 2 and "alphabet" in bad.output
    gone = CliRunner().invoke(app, ["probe", "--base-url", http.base_url, "--model", "nope", "--extract"])
    assert gone.exit_code == 2 and "404" in gone.output


@dataclass
class BpeCache(FakeCache):
    """Two characters a token, as a BPE tokenizer might: the cache matches characters (``report`` exact), the
    server reports tokens, exactly or in whole blocks."""

    token_report: str = "exact"  # exact | block

    def send(self, who: str, prompt: str) -> Reply:
        reply = super().send(who, prompt)
        assert reply.cached_tokens is not None
        tokens = reply.cached_tokens // 2
        if self.token_report == "block":
            tokens = tokens // self.block * self.block
        return Reply(tokens, reply.prompt_tokens, reply.seconds)


@pytest.mark.parametrize(("report", "unit"), [("exact", "exact per token"), ("block", "in whole blocks of 16 tokens")])
def test_token_counts_on_a_bpe_server_are_named_not_called_irregular(report: str, unit: str) -> None:
    """The calibration asks character lengths and gets token counts back, which follow no block size in
    characters. With the server's tokenizer the report names what they count, and the attack falls back to
    TTFT, since one character does not complete a token; without it they are only irregular."""
    cfg = ExtractConfig(**{**SMALL, "seed": 3})  # type: ignore[arg-type]
    cache = BpeCache("exact", noise=0.01, token_report=report)
    r = extract(
        FakeSender(cache, "attacker"), FakeSender(cache, "victim"), cfg, token_count=lambda t: (len(t) + 1) // 2
    )
    assert r.channel == "ttft" and r.granularity is None
    assert any(n.startswith(f"cached_tokens is {unit} (") for n in r.notes), r.notes
    cache = BpeCache("exact", noise=0.01, token_report=report)
    r = extract(FakeSender(cache, "attacker"), FakeSender(cache, "victim"), cfg)
    assert any("follow no block size" in n for n in r.notes), r.notes
