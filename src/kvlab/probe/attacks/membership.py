"""The membership strategy of ``kvlab probe --extract``: is this exact prompt in the cache? (InputSnatch; the
promotion threat of docs/serving.md, "What is shared with whom".)

The candidates are whole prompts: a ``--candidates`` file's lines, of which the simulated victim sends one, or
the victim's prompt (a known prefix, a secret, a private note) and ``decoys`` others that differ only in the
secret, fresh in each of ``membership_rounds`` rounds. The attacker sends each candidate (plus a filler, so
its last token can count) and reads the cached tokens:

- on a server that shares the victim's cache with the attacker, the victim's prompt hits whole on its first
  send, a decoy only as far as the prefix;
- on a server with popularity promotion (kvlab ``--promote-after K``: a block chain that K tenants computed
  becomes public), an attacker holding K - 1 keys promotes the victim's chain with its first send of the right
  guess, so its *second* send is keyed public and misses its own private copy, and the third finds the public
  one: ``P/P/full`` for the right guess against ``P/full/full`` for a wrong one. So each candidate is sent up to
  three times, with no victim request between: a whole hit ends it after one send, a whole hit on the second
  after two (the attacker's own copy: nothing learnt), a third send that finds more than the second is the
  promotion signature.

Before the candidates, the attacker sends the prefix every candidate shares three times, so that its own
copy (or its promotion) is settled and a candidate's sends differ only past it; the prefix's own sequence is
reported (under promotion it is itself a membership signal: another tenant sent that prefix).

A round picks the single candidate with a signal, if exactly one has one. The verdict: a leak when the picks
find the victim's prompt more often than chance would (a binomial tail over the rounds, 1 / candidates a
round, at most ``alpha``); no leak when no candidate showed any signal and every victim prompt could have.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvlab.probe.attacks.base import FILLERS, Candidate, Step, common_prefix, tokens
from kvlab.probe.attacks.tokens import TokenizerAccess, byte_level, channel_in_tokens

if TYPE_CHECKING:
    from kvlab.probe.attacks.traffic import Attack

NOTE = (
    " and the rest of the victim's private note for the assistant, long enough to fill several blocks of its "
    "own: the customer's order history, the open ticket and what was promised to them last week."
)
SIGNALS = ("hit", "promoted")


def binomial_tail(k: int, n: int, q: float) -> float:
    """P(X >= k) for X ~ Binomial(n, q): scipy's ``binomtest`` with alternative "greater"."""
    if k <= 0:
        return 1.0
    from scipy.stats import binomtest  # imported here: importing the probe stays cheap

    return float(binomtest(k, n, q, alternative="greater").pvalue)


def run_membership(run: Attack, tokenizer: TokenizerAccess | None) -> None:
    report, cfg = run.report, run.cfg
    report.strategy = "membership"
    if not channel_in_tokens(run, tokenizer):
        why = (
            "the membership strategy needs a count channel (cached_tokens or /metrics); this server shows hits "
            "only in TTFT, which it does not time"
        )
        report.steps.append(Step(0, 0, 0, 0, "inconclusive", detail=why))
        report.verdict, report.reason = "inconclusive", why + " (not a proof of safety)"
        return
    g = report.granularity or 1
    text_mode = byte_level(tokenizer, cfg.alphabet, NOTE)
    count: Callable[[str], int] = tokens if text_mode or tokenizer is None else lambda t: tokenizer.count(t) or 0
    margin = 0 if text_mode else 1  # a BPE filler may re-merge the candidate's last token
    filler = next(f for f in FILLERS if f not in cfg.alphabet)
    rng = random.Random(cfg.seed)
    rounds = candidate_rounds(run, rng, count, g)
    report.candidates = len(rounds[0][0])
    picks: list[bool | None] = []  # per round: the pick was the victim's (True), a decoy (False), none (None)
    for r, (prompts, labels, truth) in enumerate(rounds):
        run.victim_prompts = [prompts[truth]]
        run.resend_victims()
        sent: list[str] = []
        known = prompts[0][: min(common_prefix(prompts[0], p) for p in prompts[1:])]
        if count(known) >= g:
            seq = [run.hits(run.attack(known + filler, resend=False)) for _ in range(3)]
            sent.append(known + filler)
            if r == 0:
                report.prefix_chars = len(known)
                report.prefix_hit_tokens = seq[0]
                report.prefix_visible = seq[0] >= count(known) // g * g
                report.notes.append(
                    f"the candidates' shared prefix ({len(known)} characters), sent 3 times: cached "
                    + "/".join(map(str, seq))
                    + (" (promoted after the first: another tenant had computed it)" if seq[1] < seq[2] else "")
                )
        order = list(range(len(prompts)))
        rng.shuffle(order)
        results: list[Candidate] = []
        for i in order:
            prompt = prompts[i]
            cand = Candidate(r, labels[i], len(prompt), truth=i == truth)
            whole = (count(prompt) - margin) // g * g
            own = max((common_prefix(prompt + filler, s) for s in sent), default=0)
            own_level = count((prompt + filler)[:own]) // g * g
            if whole <= 0 or own_level >= whole:
                cand.signal = "uninformative"
            else:
                cand.sends, cand.signal = _sequence(run, prompt + filler, whole)
                sent.append(prompt + filler)
            results.append(cand)
            run.on_step()
        report.membership.extend(results)
        signalled = [c for c in results if c.signal in SIGNALS]
        picks.append(signalled[0].truth if len(signalled) == 1 else None)
    _conclude(run, picks)


def _sequence(run: Attack, prompt: str, whole: int) -> tuple[list[int], str]:
    """Up to three sends of one candidate, nothing of the victim's between them (it may re-send before the
    first, when due); their hits and the signal."""
    sends = [run.hits(run.attack(prompt))]
    if sends[0] >= whole:
        return sends, "hit"
    sends.append(run.hits(run.attack(prompt, resend=False)))
    if sends[1] >= whole:
        return sends, "none"
    sends.append(run.hits(run.attack(prompt, resend=False)))
    return sends, "promoted" if sends[2] > sends[1] else "none"


def candidate_rounds(
    run: Attack, rng: random.Random, count: Callable[[str], int], block: int
) -> list[tuple[list[str], list[str], int]]:
    """Per round: the candidate prompts, their labels, and the index of the victim's. A generated candidate's
    note runs a whole ``block`` past its secret: the block that holds the secret must be complete for a hit on
    it to show (vLLM's CPU blocks are 128 tokens; one ``NOTE`` is far shorter)."""
    cfg, report = run.cfg, run.report
    note = NOTE
    while count(note) < block + 8:  # a margin for the tokens the secret and the note share at their seam
        note += NOTE
    if cfg.candidates is not None:
        prompts = list(cfg.candidates)
        return [(prompts, [f"line {i + 1}" for i in range(len(prompts))], prompts.index(report.secret))]
    out = []
    for r in range(cfg.membership_rounds):
        prefix = f"[{run.run_id}-m{r}] Internal note for the assistant. The access code is: "
        secret = report.secret if r == 0 else "".join(rng.choice(cfg.alphabet) for _ in report.secret)
        others: set[str] = set()
        while len(others) < cfg.decoys:
            other = "".join(rng.choice(cfg.alphabet) for _ in secret)
            if other != secret:
                others.add(other)
        secrets = [secret, *sorted(others)]
        labels = ["victim", *(f"decoy {j + 1}" for j in range(len(others)))]
        out.append(([prefix + s + note for s in secrets], labels, 0))
    return out


def _conclude(run: Attack, picks: list[bool | None]) -> None:
    report, cfg = run.report, run.cfg
    n, rounds = report.candidates or 1, len(picks)
    right = sum(1 for p in picks if p)
    wrong = sum(1 for p in picks if p is False)
    p_value = binomial_tail(right, rounds, 1 / n) if right else 1.0
    report.chance = p_value
    victims = [c for c in report.membership if c.truth]
    decoys_signalled = [c for c in report.membership if not c.truth and c.signal in SIGNALS]
    kinds = sorted({c.signal for c in victims if c.signal in SIGNALS})
    how = {"hit": "a whole hit on its first send (a shared cache)", "promoted": "the promotion signature"}
    step = Step(0, 0, n * rounds, sum(len(c.sends) > 0 for c in report.membership), "no hit")
    if right:
        step.outcome, step.correct = "singled out", True
    report.steps.append(step)
    first = report.membership[:n]
    decoy_seqs = sorted({"/".join(map(str, c.sends)) or "-" for c in first if not c.truth})
    victim_seq = next(("/".join(map(str, c.sends)) or "-" for c in first if c.truth), "-")
    seqs = f"cached tokens of the victim's prompt {victim_seq}, of the decoys {', '.join(decoy_seqs)}"
    if right and p_value <= cfg.alpha:
        step.outcome = "recovered"
        report.recovered = report.secret if picks[0] else ""  # the victim's prompt (its secret part) is known
        report.correct_chars = len(report.recovered)
        verdict = "leak"
        why = (
            f"the victim's prompt was singled out in {right} of {rounds} round(s) among {n} candidates each, by "
            f"{' and '.join(how[k] for k in kinds)}; chance would do it with probability {p_value:.2g}"
            + (f" (a decoy was picked in {wrong} round(s))" if wrong else "")
        )
        if cfg.candidates is None:  # generated candidates: what the secret itself would cost
            from kvlab.probe.attacks.dictionary import candidate_count, whole_cost

            n_secret = candidate_count(cfg)
            why += f"; recovering the secret itself among its {n_secret:,} candidates would cost {whole_cost(n_secret)}"
    elif not decoys_signalled and victims and all(c.signal == "none" for c in victims):
        verdict = "no leak"
        why = (
            f"in {rounds} round(s) the victim's prompt looked like every decoy (no whole hit, no promotion "
            f"signature; round 1: {seqs})"
        )
    elif decoys_signalled:
        verdict = "inconclusive"
        why = (
            f"{len(decoys_signalled)} decoy(s) showed a signal too: the channel is noisy here (round 1: {seqs}) "
            "(not a proof of safety)"
        )
    else:
        verdict = "inconclusive"
        why = (
            f"the victim's prompt was singled out in {right} of {rounds} round(s) among {n}: probability "
            f"{p_value:.2g} by chance > {cfg.alpha} (round 1: {seqs}) (not a proof of safety)"
        )
    step.detail = why
    report.verdict, report.reason = verdict, why


__all__ = ["NOTE", "binomial_tail", "candidate_rounds", "run_membership"]
