"""The contamination criterion, the material and the timing statistics: pure functions, no server."""

from __future__ import annotations

import math

import pytest

from kvlab.openai_http import cached_tokens_of, server_root
from kvlab.probe.client import Answer
from kvlab.probe.compare import MIN_MATCH, calibrate, classify, reachable
from kvlab.probe.material import TAG_CHARS, ReuseFileError, default_reuse_groups, new_nonce, parse_reuse_groups, tag
from kvlab.probe.timing import auc, rank_test


def ids(*xs: int) -> Answer:
    return Answer("", tuple(xs))


def text(s: str) -> Answer:
    return Answer(s, None)


def test_calibration_takes_the_longest_chance_match_among_unrelated_references() -> None:
    refs = [("a", ids(1, 2, 3, 4, 5, 6)), ("a", ids(1, 2, 3, 9, 9, 9)), ("b", ids(1, 2, 7, 7)), ("c", ids(8))]
    crit = calibrate(refs, "tokens")
    # Related pairs (same family) do not count: only a-b, a-c, b-c, whose longest common prefix is 2.
    assert crit.chance_max == 2 and crit.pairs == 5 and crit.min_match == MIN_MATCH["tokens"]
    crit = calibrate([("a", ids(*range(10))), ("b", ids(*range(6), 99))], "tokens")
    assert crit.chance_max == 6 and crit.min_match == 7
    assert "7 tokens" in crit.statement() and "6 tokens" in crit.statement()


def test_contamination_needs_a_match_beyond_the_references_parting_point() -> None:
    crit = calibrate([("a", ids(1)), ("b", ids(2))], "tokens")  # min_match = the floor, 4
    own, other = ids(1, 2, 3, 4, 5, 6, 7), ids(1, 2, 9, 9, 9, 9, 9)  # they part after 2 tokens
    refs = [own, other]
    assert classify(ids(1, 2, 3, 4, 5, 6, 7), 0, refs, crit).outcome == "same"
    v = classify(ids(1, 2, 9, 9, 9, 9, 0), 0, refs, crit)
    assert v.outcome == "contaminated" and v.closest_other == 1 and v.excess == 4
    # Three tokens of the other's continuation: chance can do that here; so it is only "diverged".
    assert classify(ids(1, 2, 9, 9, 9, 0, 0), 0, refs, crit).outcome == "diverged"
    assert classify(ids(1, 2, 3, 4, 0, 0, 0), 0, refs, crit).outcome == "diverged"
    # A reference equal to our own cannot tell contamination from correctness.
    assert classify(ids(1, 2, 3, 0), 0, [own, own], crit).outcome == "diverged"


def test_text_sharing_a_few_characters_is_not_contamination() -> None:
    """Issue 17, item 5: an answer sharing two characters with another prompt's reference, or naming its own
    passphrase in the other's words, was called contaminated when text was compared character by character."""
    own = text("Le mot de passe est faucon ambre.")
    other = text("Le mot: loutre argentee.")
    crit = calibrate([("a", own), ("b", text("La pluie tombe.")), ("c", text("Il fait beau."))], "characters")
    assert crit.min_match == MIN_MATCH["characters"]
    assert classify(text("Le mot: faucon ambre."), 0, [own, other], crit).outcome == "diverged"
    assert classify(text("Le mot: loutre argentee."), 0, [own, other], crit).outcome == "contaminated"
    # A group whose answers are too short to follow anyone past the criterion cannot show contamination.
    assert not reachable([text("ab"), text("ac")], crit)


def test_every_run_tags_its_prompts_with_a_fresh_nonce() -> None:
    a, b = new_nonce(), new_nonce()
    assert a != b and len(tag(a, "x")) == TAG_CHARS + 1
    # Reuse groups: after the shared prefix, the attacker's remainder is the victim's chunk, later on.
    for g in default_reuse_groups():
        victim, attacker = g.victim(a, g.secrets[0]), g.attacker(a)
        assert victim.endswith(g.chunk) and attacker == tag(a, g.prefix + g.chunk)
        assert g.prefix.endswith("\n") and all(s.endswith("\n") for s in g.secrets)
        assert len(g.control(a, g.secrets[0])) == len(victim) and g.chunk not in g.control(a, g.secrets[0])
    with pytest.raises(ReuseFileError, match="secrets"):
        parse_reuse_groups("groups: [{name: x, prefix: p, chunk: c, secrets: []}]", "f.yaml")


def test_the_experiments_passphrases_are_unchanged_by_the_probe_groups() -> None:
    from kvlab.experiment.passphrases import default_passphrases

    assert [g.name for g in default_passphrases().groups] == ["seed-weather", "long-zh", "english", "near-miss"]


def test_auc_and_its_exact_p_value() -> None:
    assert auc([1.0, 2.0], [3.0, 4.0]) == 1.0 and auc([3.0], [1.0]) == 0.0 and auc([1.0], [1.0]) == 0.5
    hits, misses = [0.01 * i for i in range(8)], [1 + 0.01 * i for i in range(8)]
    assert rank_test(hits, misses)[0] == pytest.approx(1 / math.comb(16, 8))  # exact
    same = [1.0] * 8
    assert rank_test(same, same)[0] == 1.0


def test_cached_tokens_are_read_wherever_the_server_puts_them() -> None:
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": 32}}}) == 32
    assert cached_tokens_of({"timings": {"cache_n": 7}}) == 7  # llama.cpp, OpenAI endpoints
    assert cached_tokens_of({"tokens_cached": 5}) == 5  # llama.cpp, native endpoint
    assert cached_tokens_of({"usage": {"prompt_tokens": 3}}) is None
    assert server_root("http://h:1/api/v1/") == "http://h:1/api"


def test_changes_far_above_the_servers_own_variance_are_a_leak() -> None:
    """A server that varies on its own (here: copies of one prompt in a burst disagree, as they do when a cache
    without copy-on-write lets copies write into each other's blocks) still shows shared state when answers
    change under cross-traffic far more often than copies in bursts of themselves, the control with the same
    concurrency (one-sided Fisher, 0.01); repeats alone are no control for that."""
    from kvlab.probe.bursts import BurstResult
    from kvlab.probe.compare import Criterion, fisher_greater
    from kvlab.probe.determinism import Determinism
    from kvlab.probe.report import RATE_ALPHA, contamination_finding

    crit = Criterion("tokens", 4, 2, 10, 4)
    varies = Determinism(prompts=12, alone=24, alone_differ=0, burst=60, burst_differ=10)
    far = BurstResult(counts={"same": 48, "diverged": 72})  # 60% against 17% of the copies
    assert fisher_greater(72, 120, 10, 60) < RATE_ALPHA
    assert contamination_finding(far, varies, crit).verdict == "leak"
    near = BurstResult(counts={"same": 96, "diverged": 24})  # 20% against 17%: within its own variance
    finding = contamination_finding(near, varies, crit)
    assert finding.verdict == "inconclusive" and "not deterministic on its own" in finding.reason
    steady = Determinism(prompts=12, alone=24, burst=60)  # deterministic: any change under cross-traffic counts
    assert contamination_finding(BurstResult(counts={"same": 119, "diverged": 1}), steady, crit).verdict == "leak"
    # The exact tail: 3 of 3 against 0 of 3 has p = 1 / C(6, 3).
    assert abs(fisher_greater(3, 3, 0, 3) - 1 / 20) < 1e-12 and fisher_greater(0, 5, 0, 5) == 1.0
    assert fisher_greater(5, 10, 0, 0) == 1.0  # no copies to compare with: no evidence either way


def test_copies_batched_under_salts_of_their_own_tell_a_shared_cache_from_batch_noise() -> None:
    """A cache without copy-on-write makes copies of one prompt disagree (they write into each other's blocks),
    so plain copies cannot tell it from a server whose batched arithmetic varies; copies batched under a salt
    each can: they share no cache entry. Unchanged under salts while changed under cross-traffic: a leak, at
    rates the Fisher test alone could not separate (21 of 72 against 9 of 60 copies: p ~ 0.05, the flake this
    control removed). Salted copies that vary too: batch noise, inconclusive as before."""
    from kvlab.probe.bursts import BurstResult
    from kvlab.probe.compare import Criterion, fisher_greater
    from kvlab.probe.determinism import Determinism
    from kvlab.probe.report import RATE_ALPHA, contamination_finding

    crit = Criterion("tokens", 4, 2, 10, 4)
    observed = BurstResult(counts={"same": 51, "diverged": 21})
    assert fisher_greater(21, 72, 9, 60) > RATE_ALPHA
    shared_cache = Determinism(prompts=10, alone=20, burst=60, burst_differ=9, salted=60, salted_differ=0)
    finding = contamination_finding(observed, shared_cache, crit)
    assert finding.verdict == "leak" and "under salts of their own" in finding.reason
    assert "0 of 60 under a salt each" in finding.reason
    batch_noise = Determinism(prompts=10, alone=20, burst=60, burst_differ=9, salted=60, salted_differ=8)
    assert contamination_finding(observed, batch_noise, crit).verdict == "inconclusive"
    no_salts = Determinism(prompts=10, alone=20, burst=60, burst_differ=9)  # a server that refuses cache_salt
    assert contamination_finding(observed, no_salts, crit).verdict == "inconclusive"
    unsteady = Determinism(prompts=10, alone=20, alone_differ=2, burst=60, burst_differ=9, salted=60)
    assert contamination_finding(observed, unsteady, crit).verdict == "inconclusive"  # alone varies: no control
