"""``kvlab probe --extract``: the prompt-extraction attack on a shared prefix cache, run black-box.

The scenario. A simulated *victim* keeps sending ``prefix + secret``: the secret is a random string from a
small alphabet, new every run. The *attacker* knows the prefix and the alphabet (as it would know a
product's system prompt template) and recovers the secret from the left. For each candidate continuation
it sends ``prefix + recovered + candidate + FILLER`` and asks how much of its prompt the server found
cached: if the candidate is right, the hit reaches past the known part, because the victim's prompt put
exactly those tokens in the cache. The filler is one character outside the alphabet: a server never
counts the last prompt token as cached (its forward pass yields the first output), so without it the
candidate's own last character could never show up as a hit.

Channels, in the order a calibration with the attacker's own prompts admits them: the response's
``usage.prompt_tokens_details.cached_tokens``; the prefix-cache-hit counter of the server's /metrics
(``probe.metrics``, read around each attacker request, one at a time), when it is finer than the field,
since a server that hides or coarsens ``cached_tokens`` may count every hit there; TTFT otherwise. A count
reported in blocks of G tokens shows a hit only when the candidate completes a block, so one step guesses
every string up to the next boundary and gives up (``unreachable``) past ``max_candidates``; the simulated
victim's prefix is padded to put that boundary as far in as the budget reaches, because a probe must show
the worst case (``--prefix`` keeps your own layout). TTFT compares candidates by rank within repeats, so
slow drift between repeats cannot fake a winner, and one right character saves only one token of prefill,
often within an HTTP request's noise: expect ``inconclusive`` on a busy machine. Whether the victim's
*prefix* shows in TTFT at all is measured apart (an AUC against fresh prefixes of the same length).

The attacker's own guesses must not count as evidence. They are cached too, in the victim's tenant on a
server that shares between them (the case that matters). A per-request ``cache_salt`` would keep them
apart from the victim as well (the victim sends none), so instead every attacker prompt is
``prefix + s + FILLER`` with ``s`` over the alphabet: a candidate ``prefix + recovered + c`` could only be
matched by a guess whose alphabet part starts with ``recovered + c``, which earlier steps' guesses (no
longer than ``recovered``, then the filler) and this step's others (different inside ``c``) never have. So
a hit past ``recovered`` comes from the victim. For the same reason each TTFT repeat uses another victim
conversation, and the calibration prompts start with a character no prefix starts with. The victim
re-sends its prompt before every step and every ``victim_every`` attacker requests, so the attacker's own
traffic cannot have evicted it.

The probe made the secret, so ``decide`` checks what was recovered against chance (``alpha``); it says
``no leak`` only when a count channel was shown to work and no candidate of the first step hit, and
``inconclusive`` never claims safety.

Character = token holds for byte-level tokenizers (the mini model); on others, the positions are only
approximate and the report says so, and a character guess rarely lines up with a token (llama.cpp reports
cached tokens exactly and still gave nothing up to it).

The attacks are in ``kvlab.probe.attacks``: ``chars`` (the ``char`` strategy above) and the others, one
chosen from what the calibration measured (``ExtractConfig.strategy`` forces one): ``token`` guesses the
server's own tokens where hits are counted exactly, ``dictionary`` guesses whole low-entropy secrets where
they show only in blocks, ``membership`` asks whether a whole prompt is cached (with the three sends that
popularity promotion gives away). They share one run's traffic (``attacks.traffic.Attack``: the victim's
re-sends, the request counts, the channel) and report (``attacks.base.ExtractReport``, with the fields they
add); this module runs them against a server and renders the report.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from kvlab.probe.attacks import run_strategy
from kvlab.probe.attacks.base import ExtractConfig, ExtractReport, Prompt, Ranked, chance_of, decide
from kvlab.probe.attacks.chars import run_chars
from kvlab.probe.attacks.tokenizers import (
    LocalTokenizer,
    ServerTokenizer,
    TokenizerAccess,
    byte_level,
    load_local_tokenizer,
)
from kvlab.probe.attacks.traffic import Attack, HttpSender, Sender
from kvlab.probe.client import DEFAULT_TIMEOUT, ProbeClient, ProbeError, find_tokenizer
from kvlab.probe.metrics import find_metrics, own_hit
from kvlab.probe.progress import Phases, ProgressCallback, Tick, no_tick


def make_secret(cfg: ExtractConfig, rng: random.Random) -> str:
    """The victim's secret: ``cfg.secret``, else a random entry of the dictionary or of the candidate prompts,
    else a random string of the alphabet."""
    if cfg.secret is not None:
        return cfg.secret
    if cfg.dictionary is not None:
        return rng.choice(cfg.dictionary)
    if cfg.candidates is not None:
        return rng.choice(cfg.candidates)
    return "".join(rng.choice(cfg.alphabet) for _ in range(rng.randint(*cfg.secret_length)))


def extract(
    attacker: Sender,
    victim: Sender,
    cfg: ExtractConfig,
    *,
    base_url: str = "",
    model: str = "",
    token_count: Callable[[str], int | None] | None = None,
    counter: Callable[[], float | None] | None = None,
    on_step: Tick = no_tick,
    tokenizer: TokenizerAccess | None = None,
    ranker: Callable[[Prompt], Ranked | None] | None = None,
) -> ExtractReport:
    """Run the attack with these two identities; see the module docstring. ``token_count``: the server's
    tokenizer, where it offers one (only used to explain a token-exact cached_tokens on a BPE model);
    ``counter``: the server's prefix-cache-hit counter as the attacker reads it (/metrics), where it can;
    ``on_step``: called after every step (a guessed stretch of the secret); ``tokenizer``: the attacker's view
    of the server's tokenizer (the token and dictionary strategies; ``kvlab.probe.attacks.tokenizers``);
    ``ranker``: the server's next-token log-probabilities (the token strategy's guessing order)."""
    cfg.validate()
    t0 = time.perf_counter()
    if token_count is None and tokenizer is not None:
        token_count = tokenizer.count
    secret = make_secret(cfg, random.Random(None if cfg.seed is None else cfg.seed + 1))
    report = ExtractReport(base_url, model, cfg.alphabet, secret, 0)
    run = Attack(attacker, victim, cfg, report, token_count, counter, on_step, ranker)
    run.calibrate()
    if run_strategy(run, tokenizer):  # token, dictionary or membership: they decide their own verdicts
        report.seconds = time.perf_counter() - t0
        return report
    run_chars(run)
    report.chance = chance_of(report.steps, report.correct_chars)
    report.verdict, report.reason = decide(report, cfg.alpha)
    if report.verdict == "no leak" and tokenizer is not None and not byte_level(tokenizer, cfg.alphabet, report.secret):
        report.verdict = "inconclusive"
        report.reason = (
            "no character guess hit, but the server's tokenizer is not byte-level: a character guess does not "
            "line up with the victim's tokens, so that proves nothing (--strategy token guesses tokens; not a "
            "proof of safety)"
        )
    report.seconds = time.perf_counter() - t0
    return report


def run_extract(
    base_url: str,
    model: str,
    cfg: ExtractConfig,
    *,
    api_key: str | None = None,
    victim_api_key: str | None = None,
    metrics_api_key: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    progress: ProgressCallback | None = None,
) -> ExtractReport:
    """``extract`` against a server: the attacker and the victim each on their own pooled connection to
    ``base_url`` (with or without its ``/v1``, and nowhere else), with their own API keys. /metrics is read as
    the attacker can (no key, or its own), or with ``metrics_api_key`` for an operator auditing their own
    server. ``progress``: called as the phases (``metrics``: finding the hit counter, ``extraction``: the
    attack, a count of its steps) start, move and end (``kvlab.probe.progress``)."""
    phases = Phases(progress)
    with phases.phase("metrics"):
        check, reader = find_metrics(base_url, timeout, metrics_api_key, api_key)
    try:
        with (
            ProbeClient(base_url, model, timeout, api_key=api_key, max_connections=2) as a,
            ProbeClient(base_url, model, timeout, api_key=victim_api_key, max_connections=2) as v,
        ):
            count = None
            if find_tokenizer(a):

                def count(text: str) -> int | None:
                    ids = a.tokenize(text)
                    return None if ids is None else len(ids)

            counter = reader.hits if reader is not None else None
            attacker = HttpSender(a, cfg.attacker_salt)
            tokenizer = _tokenizer_access(a, cfg.tokenizer or model, cfg.tokenizer is not None)
            with phases.phase("extraction") as tick:
                report = extract(
                    attacker,
                    HttpSender(v, cfg.victim_salt),
                    cfg,
                    base_url=a.base_url,
                    model=model,
                    token_count=count,
                    counter=counter,
                    on_step=tick,
                    tokenizer=tokenizer,
                    ranker=attacker.top_tokens,
                )
    finally:
        if reader is not None:
            reader.close()
    check.own_hit = own_hit(report.calibration.get("counted", []))
    report.metrics = check.summary()
    return report


def _tokenizer_access(client: ProbeClient, name: str, asked: bool) -> TokenizerAccess:
    """The server's /tokenize (found by ``find_tokenizer``) and a local copy of ``name``'s tokenizer where kvlab
    can read one; a local copy the user asked for (``--tokenizer``) that cannot be read is an error."""
    local: LocalTokenizer | None = None
    notes = []
    try:
        local = load_local_tokenizer(name)
    except ValueError as exc:
        if asked:
            raise ProbeError(f"--tokenizer: {exc}") from None
        notes.append(f"no local tokenizer for {name!r} ({exc})")
    server = ServerTokenizer(client) if client.tokenize_body is not None else None
    return TokenizerAccess(server, local, notes)


def render(report: ExtractReport) -> str:
    """The report as the few lines a terminal shows."""
    r = report
    secret = f"one of {r.candidates} candidates" if r.strategy in ("dictionary", "membership") else f"{r.alphabet!r}"
    lines = [
        f"extraction probe of {r.base_url} ({r.model}): channel {r.channel_label}",
        f"  strategy: {r.strategy}" + (f" ({r.strategy_reason})" if r.strategy_reason else ""),
        f"  secret: {len(r.secret)} characters of {secret} after a {r.prefix_chars}-character known prefix",
        f"  recovered: {r.recovered!r} ({r.correct_chars} correct of {len(r.secret)}: {r.secret!r})",
        f"  requests: {r.attacker_requests} attacker + {r.victim_requests} victim in {r.seconds:.1f}s"
        + (f"; {r.requests_to_recover} until the last correct character" if r.requests_to_recover else "")
        + (f"; {r.requests_per_token} per token" if r.requests_per_token else ""),
        f"  metrics: {r.metrics}",
    ]
    if r.tokenizer:
        lines.append(f"  tokenizer: {r.tokenizer} ({r.tokenizer_requests} tokenizer requests)")
    if r.prefix_visible is not None:
        lines.append(f"  the victim's known prefix is {'' if r.prefix_visible else 'not '}visible to the attacker")
    for s in r.steps:
        got = f" -> {s.guess!r} ({'right' if s.correct else 'WRONG'})" if s.guess is not None else ""
        count = f"{len(r.alphabet)}**{s.width}" if s.outcome == "unreachable" and r.strategy == "char" else ""
        count = count or str(s.candidates)
        lines.append(f"  step @{s.position} ({s.width} char, {s.tried}/{count} tried): {s.outcome}{got}")
        if s.detail:
            lines.append(f"    {s.detail}")
    for c in r.membership:
        sends = "/".join(map(str, c.sends)) or "-"
        lines.append(f"  round {c.round + 1} {c.label}: cached {sends}: {c.signal}")
    lines += [f"  note: {n}" for n in r.notes]
    lines.append(f"  verdict: {r.verdict.upper()}: {r.reason}")
    return "\n".join(lines)


def exit_code(report: ExtractReport) -> int:
    return report.exit_code


__all__ = ["exit_code", "extract", "make_secret", "render", "run_extract"]
