"""What every attack of ``kvlab probe --extract`` shares: its configuration (``ExtractConfig``), its report
(``ExtractReport``, ``Step``, ``Candidate``), the replies it reads (``Reply``, ``Ranked``) and the pure pieces of
the character arithmetic and the verdict (``decide``). No traffic here (``traffic``), no attack (the modules
beside it); ``kvlab.probe.extract`` runs one against a server."""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_ALPHABET = "abcdefghijklmnop"
# The character calibration's conclusion where a non-byte-level tokenizer hides single characters; a strategy
# that then calibrates in tokens drops it and keeps what was found (attacks.tokens).
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


STRATEGIES = ("auto", "char", "token", "dictionary", "membership")


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
    # The token strategy's local model for its candidates' order (attacks.priors): None, the served model's
    # name where kvlab can load it; "none": no local model.
    prior_model: str | None = None
    ttft_repeats: int = 7
    ttft_alpha: float = 0.01  # p-value of the rank test below which a TTFT step picks its winner
    victim_every: int = 16  # the victim re-sends after this many attacker requests
    alpha: float = 0.01  # a recovery counts as a leak when guessing would match it with at most this chance
    seed: int | None = None  # fixes the secret and the guessing order; prefixes get a fresh id every run
    # The strategy (kvlab.probe.attacks): auto | char | token | dictionary | membership.
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
    # The strategy that ran (kvlab.probe.attacks) and what it measured beyond the fields above.
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
    def exit_code(self) -> int:
        """1 on a leak, else 0 (an extraction has no exposure; a run that could not start exits 2 before)."""
        return 1 if self.verdict == "leak" else 0

    @property
    def channel_label(self) -> str:
        if self.channel not in COUNT_CHANNELS:
            return "TTFT (time to first token; cached_tokens not usable)"
        name = "cached_tokens" if self.channel == "cached_tokens" else "the /metrics prefix-cache-hit counter"
        return f"{name}, exact" if self.granularity == 1 else f"{name}, blocks of {self.granularity}"


def validate_strategy_config(cfg: ExtractConfig) -> None:
    """The strategy options' own checks (``ExtractConfig.validate`` calls it); ValueError says what is wrong."""
    for name, entries in (("dictionary", cfg.dictionary), ("candidates", cfg.candidates)):
        if entries is None:
            continue
        if len(entries) < 2 or len(set(entries)) != len(entries) or not all(e and "\n" not in e for e in entries):
            raise ValueError(f"--{name} needs 2 or more distinct, non-empty entries of one line each")
        if cfg.secret is not None and cfg.secret not in entries:
            raise ValueError(f"the secret must be one of the --{name} entries")
    if cfg.dictionary is not None and cfg.candidates is not None:
        raise ValueError("give --dictionary (secrets) or --candidates (whole prompts), not both")
    if cfg.decoys < 1 or cfg.membership_rounds < 1:
        raise ValueError("decoys >= 1 and membership_rounds >= 1 required")
    if cfg.strategy in ("char", "token") and (cfg.dictionary is not None or cfg.candidates is not None):
        raise ValueError(f"--strategy {cfg.strategy} guesses the alphabet: it takes no --dictionary or --candidates")
    if cfg.strategy == "dictionary" and cfg.candidates is not None:
        raise ValueError("--candidates are whole prompts for --strategy membership; a dictionary is --dictionary")
    if cfg.strategy == "membership" and cfg.dictionary is not None:
        raise ValueError("--strategy membership takes --candidates (whole prompts), not --dictionary")


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
