"""``kvlab probe``'s timing (unless ``--no-timing``): can a client tell from its own requests that another's
prefix is cached?

(vLLM CVE-2025-46570: prefix-cache hits are visible in TTFT.) One sample: a "victim" sends a fresh long
prefix plus a suffix; then the "attacker" sends either the same prefix with another suffix (the *hit* arm:
a hit if the cache is shared with it) or a never-seen prefix of the same length (the *miss* arm), as a
1-token request whose latency is its TTFT. Both arms have a victim request right before the probe, so the
server's state differs only in whether the probe's prefix is the victim's: a single-slot server, which
keeps only the previous request, is measured as fairly as a block cache.

Servers decide differently what enters the cache, and one rule can hide every hit from one kind of victim:
transformers' continuous batching never registers the blocks of a request that ends during prefill (a
1-token victim), other caches admit a prompt only when it is seen again. So each measurement is repeated
for several victim *shapes* (``SHAPES``), and the report says which ones revealed the cache.

Two channels per run: TTFT (AUC = P(TTFT of a hit < TTFT of a miss), ties half; 0.5: cannot tell) and,
where the server reports it, ``cached_tokens`` (AUC of "a hit reports more"). A run *reveals* the cache
when an AUC is at least ``MIN_AUC`` and its p-value (scipy's Mann-Whitney test, exact: every split of the
samples into hits and misses counted, ``rank_test``) is at most ``alpha`` divided by the number of tests
(Bonferroni: picking the best of several shapes is paid for). Which of a run's 2n samples are the hits is drawn
at random over the whole run (not arm by arm within pairs): the rank test's p is then exact for the assignment
actually made, whatever drifts or rhythms the server and its machine have (another job's bursts, a GC), since
under "no hit is visible" every split of the samples into hits and misses was as likely to be drawn.

Power. With n hits and n misses the smallest p-value a rank test can give is 1 / C(2n, n) (ties make it
larger): with 4 pairs 1/70 = 0.014, above any alpha of 0.01 however plain the hits. So before it sends
anything ``run_timing`` raises the pairs per run to the smallest count that can reach ``alpha / tests``
(``plan_trials``; the report says it did), and afterwards a run whose own samples cannot reach it (ties) is
"not detected at this power", never clean. ``clean`` is only said at a power that could have shown a hit,
and says which (n, the smallest reachable p, the smallest AUC that would have shown).

Sizes. The prefixes must fill the server's cache blocks (128 tokens on vLLM's CPU build): the probe measures
the granularity first (``granularity``) and passes the prefix length; when no hit was found up to a bound
short of the model's context, the timing can still reveal a hit, but its non-detection is inconclusive
(``blind``). Victim and attacker may hold different API keys (``victim``): tenant B measured against tenant A.

Conditions: without salts (victim and attacker send none), and, where the server accepts ``cache_salt``,
with distinct salts. A hit visible across distinct salts is a **leak** (the salt does not isolate); visible
only without salts it is **exposure** (clients that share a cache namespace can see each other's prompts).
Every prompt carries the run's nonce (see ``material``): a re-run never meets the last run's entries.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvlab.openai_http import cached_tokens_of
from kvlab.probe.budget import Allowance
from kvlab.probe.client import ProbeClient
from kvlab.probe.material import sub_nonce, words

MIN_AUC = 0.75
EXACT_MAX = 100  # samples (hits and misses) up to which p-values are exact; a normal approximation beyond
NOT_POWERED = "not detected at this power"


@dataclass(frozen=True)
class Shape:
    name: str
    max_tokens: int  # the victim's request
    sends: int  # how often the victim sends it before the probe


SHAPES = (
    Shape("1-token victim, sent once", 1, 1),
    Shape("4-token victim, sent once", 4, 1),
    Shape("4-token victim, sent twice", 4, 2),
)


def _mann_whitney(positives: Sequence[float], negatives: Sequence[float], method: str) -> tuple[float, float]:
    """scipy's Mann-Whitney test that the negatives are the larger (the hits the faster): (U, the one-sided p).
    U counts the hit/miss pairs in which the miss is the slower, ties half."""
    from scipy.stats import mannwhitneyu  # imported here: importing the probe stays cheap

    result = mannwhitneyu(negatives, positives, alternative="greater", method=method)
    return float(result.statistic), float(result.pvalue)


def auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """P(a positive's time is below a negative's), ties half: the Mann-Whitney AUC of "faster = hit", scipy's
    U over the number of pairs."""
    if not positives or not negatives:
        raise ValueError("the AUC needs at least one hit and one miss sample")
    u, _ = _mann_whitney(positives, negatives, "asymptotic")  # the method decides the p-value only, never U
    return u / (len(positives) * len(negatives))


def midranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``; tied values share their mean rank."""
    from scipy.stats import rankdata

    return [float(r) for r in rankdata(values, method="average")]


def rank_sums(doubled_ranks: Sequence[int], k: int) -> list[float]:
    """``ways[s]``: how many ``k``-subsets of ``doubled_ranks`` (twice the midranks: integers) sum to ``s``.
    Floats (exact to 2**53, 1e-16 relative beyond); numpy, one vectorised pass per sample."""
    import numpy as np  # imported here: importing the probe stays cheap

    top = sum(sorted(doubled_ranks)[len(doubled_ranks) - k :])
    ways = np.zeros((k + 1, top + 1))
    ways[0, 0] = 1.0
    for r in doubled_ranks:
        # Overlapping in-place ufuncs read their inputs as before the operation: each sample is taken once.
        ways[1:, r:] += ways[:-1, : top + 1 - r]
    return [float(w) for w in ways[k]]


def tied_p(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """The exact one-sided p of the negatives' rank sum given the samples' ties: every split of the samples into
    hits and misses counted (``rank_sums``). scipy's exact method ignores ties and rounds a half-integer U down
    (a tie across the arms makes its p too small); its tie-exact ``PermutationMethod`` lists every split, which
    the tests compare this with, too slowly for the pairs the probe plans (docs/probe.md)."""
    doubled = [round(2 * r) for r in midranks([*positives, *negatives])]
    ways = rank_sums(doubled, len(negatives))
    return min(1.0, sum(ways[sum(doubled[len(positives) :]) :]) / sum(ways))


def _p_value(positives: Sequence[float], negatives: Sequence[float]) -> float:
    values = [*positives, *negatives]
    if len(values) > EXACT_MAX:
        return _mann_whitney(positives, negatives, "asymptotic")[1]  # tie-corrected, with continuity
    if len(set(values)) == len(values):
        return _mann_whitney(positives, negatives, "exact")[1]
    return tied_p(positives, negatives)


def rank_test(positives: Sequence[float], negatives: Sequence[float]) -> tuple[float, float]:
    """(the one-sided p-value of ``auc(positives, negatives)``, the smallest p-value these samples could give
    at all: that of the split with every hit below every miss, ties kept). Null hypothesis: the labels are
    exchangeable. Up to ``EXACT_MAX`` samples exact: scipy's ``mannwhitneyu(method="exact")`` where no two
    samples are alike, ``tied_p`` where some are; beyond, scipy's tie-corrected normal approximation."""
    extreme = sorted([*positives, *negatives])
    n_pos = len(positives)
    return _p_value(positives, negatives), _p_value(extreme[:n_pos], extreme[n_pos:])


def smallest_p(trials: int) -> float:
    """The smallest p-value ``trials`` hits against ``trials`` misses can give: 1 / C(2n, n), no ties."""
    return 1 / math.comb(2 * trials, trials)


def required_trials(threshold: float) -> int:
    """The fewest hit/miss pairs whose rank test can reach ``threshold`` at all."""
    n = 1
    while smallest_p(n) > threshold:
        n += 1
    return n


def plan_trials(trials: int, alpha: float, runs: int, channels: int) -> int:
    """``trials`` raised, if need be, so that every one of ``runs * channels`` tests can reach ``alpha`` over
    their number (the Bonferroni threshold the runs are held to)."""
    return max(trials, required_trials(alpha / max(runs * channels, 1)))


def detectable_auc(trials: int, threshold: float) -> float | None:
    """The smallest AUC at which ``trials`` untied hit/miss pairs reach ``threshold`` (None: none does): the
    planning side of ``rank_test``, from the same exact distribution as scipy's (the tests hold it to scipy)."""
    n = 2 * trials
    if n > EXACT_MAX:
        sd = math.sqrt(trials * trials * (n + 1) / 12)
        # -inv_cdf(threshold), not inv_cdf(1 - threshold): below ~1e-16, 1 - threshold rounds to 1.0.
        u = trials * trials / 2 + 0.5 - sd * statistics.NormalDist().inv_cdf(threshold)
        return min(1.0, math.ceil(u) / trials**2) if u <= trials**2 else None
    ways = rank_sums([2 * r for r in range(1, n + 1)], trials)
    total, tail = sum(ways), 0.0
    base = trials * (trials + 1)  # twice the smallest rank sum
    found = None
    for s in range(len(ways) - 1, -1, -1):
        tail += ways[s]
        if tail / total > threshold:
            break
        if ways[s]:
            found = (s - base) / 2 / trials**2
    return found


@dataclass
class TimingRun:
    shape: str
    salted: bool
    hit_ttft: list[float] = field(default_factory=list)
    miss_ttft: list[float] = field(default_factory=list)
    hit_cached: list[int | None] = field(default_factory=list)
    miss_cached: list[int | None] = field(default_factory=list)
    auc: float = 0.5
    p_value: float = 1.0
    cached_auc: float | None = None  # None: the server does not report cached tokens
    cached_p_value: float | None = None
    revealed_by: list[str] = field(default_factory=list)  # channels that showed the cache: TTFT, cached_tokens
    min_p: float = 1.0  # the smallest p-value this run's TTFT samples could give (their ties kept)
    cached_min_p: float | None = None  # the same for its cached_tokens (all equal: 1)
    detection: str = "not revealed"  # revealed | not revealed | not detected at this power (``NOT_POWERED``)

    def analyse(self) -> None:
        """The AUCs and their exact p-values."""
        self.auc = auc(self.hit_ttft, self.miss_ttft)
        self.p_value, self.min_p = rank_test(self.hit_ttft, self.miss_ttft)
        hits, misses = self.hit_cached, self.miss_cached
        if hits and misses and all(c is not None for c in [*hits, *misses]):
            # "More cached" is the hit: negate, so the same "smaller = hit" statistic applies.
            neg_hits = [-float(c or 0) for c in hits]
            neg_misses = [-float(c or 0) for c in misses]
            self.cached_auc = auc(neg_hits, neg_misses)
            self.cached_p_value, self.cached_min_p = rank_test(neg_hits, neg_misses)

    def powered(self, threshold: float) -> bool:
        """Could this run's samples have shown a hit at ``threshold`` in some channel?"""
        return self.reachable() <= threshold

    def decide(self, threshold: float) -> None:
        self.revealed_by = []
        if self.auc >= MIN_AUC and self.p_value <= threshold:
            self.revealed_by.append("TTFT")
        # "is not None": past EXACT_MAX a perfect channel's p-value underflows to 0.0, the strongest evidence of all.
        p = self.cached_p_value
        if self.cached_auc is not None and self.cached_auc >= MIN_AUC and p is not None and p <= threshold:
            self.revealed_by.append("cached_tokens")
        if self.revealed_by:
            self.detection = "revealed"
        else:
            self.detection = "not revealed" if self.powered(threshold) else NOT_POWERED

    def reachable(self) -> float:
        """The smallest p-value any channel of this run could give."""
        return min(self.min_p, 1.0 if self.cached_min_p is None else self.cached_min_p)

    def brief(self) -> str:
        parts = [f"TTFT AUC {self.auc:.2f}, p {self.p_value:.2g}"]
        if self.cached_auc is not None:
            parts.append(f"cached_tokens AUC {self.cached_auc:.2f}, p {self.cached_p_value:.2g}")
        return "; ".join(parts)

    def describe(self) -> str:
        ms = (1000 * statistics.median(self.hit_ttft), 1000 * statistics.median(self.miss_ttft))
        text = f"median TTFT hit {ms[0]:.1f} ms, miss {ms[1]:.1f} ms, AUC {self.auc:.2f} (p {self.p_value:.2g})"
        if self.cached_auc is not None:
            text += f"; cached_tokens AUC {self.cached_auc:.2f}"
        return text

    def seen(self) -> str:
        """This run's outcome as the report shows it."""
        if self.revealed_by:
            return f"REVEALED by {', '.join(self.revealed_by)}"
        if self.detection == NOT_POWERED:
            return f"{NOT_POWERED} (n={len(self.hit_ttft)}, smallest reachable p={self.reachable():.2g})"
        return "not revealed"


SAME_KEY = "the probe's own API key (one tenant)"
OWN_KEY = "its own API key (--victim-api-key): another tenant"


@dataclass
class TimingReport:
    trials: int  # hit/miss pairs per run, as measured (``trials_requested`` raised where it could not reach)
    prefix_chars: int
    alpha: float
    runs: list[TimingRun] = field(default_factory=list)
    salted_measured: bool = True
    not_salted_because: str = ""
    # leak | exposure | clean | inconclusive (not detected at this power, or blind: see ``blind``)
    verdict: str = "clean"
    reason: str = ""
    trials_requested: int = 0  # 0: as measured
    tests: int = 0  # the runs' tests (one per channel): alpha is split over them
    threshold: float = 0.0  # alpha / tests: the p-value a run must reach
    smallest_p: float = 1.0  # the smallest p-value ``trials`` untied pairs can give: 1 / C(2n, n)
    detectable_auc: float | None = None  # the smallest AUC that reaches ``threshold`` with ``trials`` pairs
    powered: bool = True  # every run that revealed nothing could have (its own smallest p <= threshold)
    victim: str = SAME_KEY  # whose key the victim's requests carried
    granularity: str = ""  # the server's cache granularity as measured first (``granularity.Granularity``)
    prefix_tokens: int | None = None  # the prefixes' length in tokens, as the granularity search counted them
    blind: str = ""  # set: no hit was found up to a bound short of the context; a non-detection proves nothing
    cut: str = ""  # what the time budget left out of the plan, and the power it cost ("": nothing)
    notes: list[str] = field(default_factory=list)

    def revealing(self, salted: bool) -> list[TimingRun]:
        return [r for r in self.runs if r.salted == salted and r.revealed_by]

    def salt_handling(self) -> str | None:
        """What the timing says of salts: honoured, ignored, or None (the cache never showed, no salts, or the
        salted runs could not have shown a hit)."""
        if not self.salted_measured:
            return None
        if self.revealing(True):
            return "ignored"
        salted = [r for r in self.runs if r.salted]
        if self.revealing(False) and salted and all(r.detection == "not revealed" for r in salted):
            return "honoured"
        return None

    def power(self) -> str:
        requested = self.trials_requested or self.trials
        raised = f" (raised from {requested})" if self.trials > requested else ""
        raised = f" (cut from {requested} for the time budget)" if self.trials < requested else raised
        shows = f"; an AUC >= {self.detectable_auc:.2f} would show" if self.detectable_auc is not None else ""
        op = "<=" if self.smallest_p <= self.threshold else ">"
        return (
            f"n={self.trials} pairs per run{raised}, smallest reachable p={self.smallest_p:.2g} {op} alpha/tests="
            f"{self.alpha:g}/{self.tests}={self.threshold:.2g}{shows}"
        )

    def conclude(self) -> None:
        tests = sum(1 + (r.cached_auc is not None) for r in self.runs)
        self.tests, self.threshold = tests, self.alpha / max(tests, 1)
        self.smallest_p, self.detectable_auc = smallest_p(self.trials), detectable_auc(self.trials, self.threshold)
        for r in self.runs:
            r.decide(self.threshold)
        salted, plain = self.revealing(True), self.revealing(False)
        weak = [r for r in self.runs if r.detection == NOT_POWERED]
        self.powered = not weak
        whose = " (the victim on its own API key: across tenants)" if self.victim == OWN_KEY else ""

        def shapes(runs: list[TimingRun]) -> str:
            return "; ".join(f"{r.shape} ({r.brief()})" for r in runs)

        def unpowered(runs: list[TimingRun]) -> str:
            worst = max(r.reachable() for r in runs)
            return (
                f"{NOT_POWERED} (n={self.trials}, smallest reachable p={worst:.2g} > alpha/tests={self.threshold:.2g}"
                f"; ties in the samples): {', '.join(('distinct salts, ' if r.salted else '') + r.shape for r in runs)}"
            )

        if not self.runs:
            self.verdict, self.reason = "inconclusive", self.cut or "no timing run was measured"
        elif salted:
            self.verdict = "leak"
            self.reason = f"a cache hit is visible across distinct salts{whose}: {shapes(salted)}"
        elif plain:
            hidden = [r.shape for r in self.runs if not r.salted and not r.revealed_by]
            tail = f"; not revealed by: {', '.join(hidden)}" if hidden else ""
            tail += f"; {unpowered([r for r in weak if r.salted])}" if any(r.salted for r in weak) else ""
            self.verdict = "exposure"
            self.reason = f"a cache hit is visible to clients without salts{whose}: revealed by {shapes(plain)}{tail}"
        elif weak:
            self.verdict, self.reason = "inconclusive", unpowered(weak)
        elif self.blind:
            best = max(self.runs, key=lambda r: r.auc)
            self.verdict = "inconclusive"
            self.reason = f"{self.blind}; no victim shape revealed one either (best: {best.shape}, {best.describe()})"
        else:
            best = max(self.runs, key=lambda r: r.auc)
            self.verdict = "clean"
            self.reason = (
                f"no cache hit visible with any victim shape{whose} at this power ({self.power()}; best: {best.shape}, "
                f"{best.describe()}): no sharing, or hits below this machine's timing noise"
            )

    def render(self) -> str:
        tokens = f" (~{self.prefix_tokens} tokens)" if self.prefix_tokens else ""
        if not self.runs:
            return f"timing: {self.prefix_chars}-character prefixes{tokens}: {self.reason}"
        lines = [
            f"timing: {self.trials} hit/miss pairs per run, {self.prefix_chars}-character prefixes{tokens}; "
            f"victim: {self.victim}",
            f"  power: {self.power()}",
        ]
        if self.granularity:
            lines.append(f"  cache granularity: {self.granularity}")
        for r in self.runs:
            label = "distinct salts" if r.salted else "no salts"
            lines.append(f"  {label:14} {r.shape:28} {r.describe()}: {r.seen()}")
        if not self.salted_measured:
            lines.append(f"  distinct salts: not measured ({self.not_salted_because})")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class Sampler:
    """The run's traffic: fresh prompts (texts from the nonce), the structure from the seed's generator. The
    attacker's probes go through ``client``, the victim's requests through ``victim`` (its own API key; the
    attacker's client when None: one tenant)."""

    def __init__(self, client: ProbeClient, nonce: str, prefix_chars: int, victim: ProbeClient | None = None) -> None:
        self.client, self.nonce, self.prefix_chars = client, nonce, prefix_chars
        self.victim = victim if victim is not None else client
        self.text_rng = random.Random(f"timing-{nonce}")
        self.count = 0

    def fresh(self, kind: str) -> str:
        """A new prefix. Victims' start with "v", misses' with "m": a miss shares not even its first character
        with a victim's prompt (kvlab reuses a free cached block in place when the first token matches)."""
        self.count += 1
        head = f"{kind}{sub_nonce(self.nonce, f'timing-{self.count}')} "
        return head + words(self.text_rng, self.prefix_chars - len(head))

    def salt(self, who: str) -> str:
        self.count += 1
        return f"{who}-{sub_nonce(self.nonce, f'salt-{self.count}')}"

    def probe(self, prompt: str, salt: str | None) -> tuple[float, int | None]:
        data, seconds = self.client.completion(prompt, 1, salt=salt)
        return seconds, cached_tokens_of(data)

    def sample(self, run: TimingRun, shape: Shape, arm: str) -> None:
        victim_salt, attacker_salt = (self.salt("victim"), self.salt("attacker")) if run.salted else (None, None)
        prefix = self.fresh("v")
        for _ in range(shape.sends):
            self.victim.completion(prefix + " A", shape.max_tokens, salt=victim_salt)
        probe = prefix + " B" if arm == "hit" else self.fresh("m") + " B"
        seconds, cached = self.probe(probe, attacker_salt)
        (run.hit_ttft if arm == "hit" else run.miss_ttft).append(seconds)
        (run.hit_cached if arm == "hit" else run.miss_cached).append(cached)


def timing_plan(trials: int, alpha: float, shapes: int, salts: bool, cached_tokens: bool) -> tuple[int, int]:
    """(runs, hit/miss pairs per run) ``run_timing`` plans: every shape without salts and, with ``salts``, with
    distinct ones; each run's pairs by ``plan_trials`` for its tests (a second one where cached_tokens report)."""
    runs = (2 if salts else 1) * shapes
    return runs, plan_trials(trials, alpha, runs, 1 + cached_tokens)


@dataclass(frozen=True)
class Fit:
    """What of the timing plan fits the time budget: the first ``shapes`` victim shapes, ``pairs`` per run."""

    shapes: int
    pairs: int
    planned: int  # the pairs per run asked for (raised as ``timing_plan`` raises them)
    shapes_planned: int
    seconds: float  # the estimated cost of what fits

    @property
    def whole(self) -> bool:
        return self.pairs >= self.planned and self.shapes == self.shapes_planned


def fit_plan(
    trials: int,
    alpha: float,
    shapes: Sequence[Shape],
    salts: bool,
    cached_tokens: bool,
    request_seconds: float,
    seconds: float,
) -> Fit:
    """The most of the plan that fits ``seconds`` at ``request_seconds`` a request (a miss of a timing prefix):
    every shape at the planned pairs if it fits; else as many pairs as fit, down to the fewest whose tests can
    reach alpha at all; else the same with fewer shapes (fewer tests, so fewer pairs needed); ``shapes`` 0 where
    not even one shape's runs fit. A pair costs the victim's sends and the probe, for the hit and the miss."""
    conditions = 2 if salts else 1
    planned = timing_plan(trials, alpha, len(shapes), salts, cached_tokens)[1]
    for k in range(len(shapes), 0, -1):
        runs = conditions * k
        want = plan_trials(trials, alpha, runs, 1 + cached_tokens)
        least = plan_trials(1, alpha, runs, 1 + cached_tokens)
        pair = conditions * sum(2 * (s.sends + 1) for s in shapes[:k]) * request_seconds
        fits = int(seconds // pair) if pair > 0 else want
        if fits >= least:
            n = min(want, fits)
            return Fit(k, n, planned, len(shapes), n * pair)
    return Fit(0, 0, planned, len(shapes), 0.0)


def _cut_note(fit: Fit, miss_seconds: float, left: float, alpha: float, conditions: int, channels: int) -> str:
    """What the time budget left out of the timing plan and the power that cost, as the report says it."""
    paced = f"{left:.0f} s left for the timing, a miss of its prefix took {miss_seconds:.2g} s"
    if not fit.shapes:
        least = plan_trials(1, alpha, conditions, channels)
        return (
            f"not measured for the time budget ({paced}): not even one victim shape's runs at the fewest pairs "
            f"that can reach alpha ({least}) fit (--max-seconds raises the budget)"
        )
    tests = conditions * fit.shapes * channels
    planned_tests = conditions * fit.shapes_planned * channels
    now, then = detectable_auc(fit.pairs, alpha / tests), detectable_auc(fit.planned, alpha / planned_tests)
    shown = "no AUC" if now is None else f"an AUC >= {now:.2f}"
    planned = "none" if then is None else f"{then:.2f}"
    return (
        f"cut for the time budget ({paced}): {fit.pairs} of {fit.planned} pairs per run, {fit.shapes} of "
        f"{fit.shapes_planned} victim shapes; {shown} would show where the plan's would show {planned} (--max-seconds "
        "raises the budget)"
    )


def run_timing(
    client: ProbeClient,
    *,
    nonce: str,
    trials: int = 8,
    prefix_chars: int = 400,
    seed: int = 0,
    salts: bool = True,
    not_salted_because: str = "",
    alpha: float = 0.01,
    shapes: Sequence[Shape] = SHAPES,
    on_trial: Callable[[], None] | None = None,
    victim: ProbeClient | None = None,
    cached_tokens: bool = True,
    blind: str = "",
    granularity: str = "",
    prefix_tokens: int | None = None,
    allowance: Allowance | None = None,
) -> TimingReport:
    """Every shape without salts, then (if ``salts``) with distinct salts; see the module docstring.
    ``on_trial`` is called after every second sample (the probe's progress: ``plan_trials`` pairs per shape and
    condition). ``victim``: the victim's client (its own API key), None for the attacker's; ``cached_tokens``:
    whether the server reports them (a second test per run, so a stricter threshold to plan for); ``blind``,
    ``granularity``, ``prefix_tokens``: what the granularity search found (see ``TimingReport``);
    ``allowance``: the timing's share of the time budget (``fit_plan`` decides what of the plan fits it, at the
    pace of one more timed miss)."""
    rng = random.Random(seed)  # the structure: which of a run's samples are hits
    conditions = (False, True) if salts else (False,)
    planned = timing_plan(trials, alpha, len(shapes), salts, cached_tokens)[1]
    sampler = Sampler(client, nonce, prefix_chars, victim)
    sampler.probe(sampler.fresh("w"), None)  # discarded: the first request pays for lazy initialisation
    if victim is not None:
        victim.completion(sampler.fresh("w"), 1)  # the victim's connection too
    cut = ""
    if allowance is not None and allowance.bounded:
        miss_seconds, _ = sampler.probe(sampler.fresh("m"), None)
        left = max(allowance.left(), 0.0)
        fit = fit_plan(trials, alpha, shapes, salts, cached_tokens, miss_seconds, left)
        if not fit.whole:
            planned, shapes = fit.pairs, shapes[: fit.shapes]
            cut = _cut_note(fit, miss_seconds, left, alpha, len(conditions), 1 + cached_tokens)
    report = TimingReport(planned, prefix_chars, alpha, salted_measured=salts, not_salted_because=not_salted_because)
    report.trials_requested, report.victim = trials, SAME_KEY if victim is None else OWN_KEY
    report.blind, report.granularity, report.prefix_tokens = blind, granularity, prefix_tokens
    report.cut = cut  # the report says it once, with the run's other cuts (probe.report)
    if planned > trials:
        tests = len(conditions) * len(shapes) * (1 + cached_tokens)
        report.notes.append(
            f"raised from {trials} to {planned} hit/miss pairs per run: with {trials} the smallest reachable p "
            f"(1/C({2 * trials},{trials}) = {smallest_p(trials):.2g}) is above alpha/tests = {alpha:g}/{tests} = "
            f"{alpha / tests:.2g}, so no hit could ever have shown"
        )
    for salted in conditions:
        for shape in shapes:
            run = TimingRun(shape.name, salted)
            for i, arm in enumerate(rng.sample(["hit", "miss"] * planned, 2 * planned)):
                sampler.sample(run, shape, arm)
                if i % 2 and on_trial is not None:
                    on_trial()
            run.analyse()
            report.runs.append(run)
    report.conclude()
    return report
