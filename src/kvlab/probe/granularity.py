"""How coarse is the server's prefix cache? Measured first, so that every prompt the probe sends can show a hit.

A prefix cache keeps whole blocks of tokens: kvlab its ``--block-size`` (16 by default), vLLM 16 on a GPU and
128 on a CPU (or its ``--block-size``), llama.cpp every token (granularity 1). A prompt that does not fill one
block never hits, whatever the sharing, so a probe whose prompts are shorter than the server's blocks is blind:
on vLLM's CPU build the old 400-character timing prefixes (~100 tokens) never filled a 128-token block and the
probe said clean. So the probe measures the granularity before anything else and sizes its timing prefixes
and salt-check prompts from it (``Granularity.prompt_chars``: at least ``BLOCKS`` blocks, within the context).

The search (``measure_granularity``): a fresh prefix of growing length (``START_TOKENS``, then doubling on the
token count the server reported), each sent twice with 2 generated tokens (caches that skip 1-token requests
or admit a prompt on its second sighting still keep it), then once more with another ending, as a 1-token
request:

- with ``cached_tokens``: the first length whose ending reports a hit, then a few lengths that tell the block
  sizes still consistent with every report apart (a report is the common prefix floored to whole blocks;
  ``kvlab.probe.extract.infer_granularity`` is the exact form of that rule);
- without it (the timing on, as unless ``--no-timing``): the first length at which the ending is clearly
  faster than a fresh prefix of the same length (every hit faster than every miss, the medians at most
  ``STEP_RATIO`` apart, in ``SCREEN_PAIRS`` pairs and again in ``CONFIRM_PAIRS`` fresh ones). TTFT gives
  only a bound: the block is at most that length. A server that reports cached_tokens as 0 throughout is
  asked the TTFT question at the longest length as well.

The bound: the model's context (``max_model_len`` of ``/v1/models``, as vLLM and kvlab offer it; or the length
a context error names), or the search's own bound where that is shorter or the context unknown
(``SEARCH_TOKENS``, the probe's ``--search-tokens``: every length is a fresh prefill, and on two cores a search
up to an 8k context took most of half an hour), or the search's share of the probe's time budget (``budget``:
a length whose prefill would end past it is not tried). No hit up to the whole context means the server keeps no
prefix cache its clients can see (``no_cache``); no hit up to the search's own bound proves nothing, and the
probe's verdicts then never say clean (``blind``).
"""

from __future__ import annotations

import json
import math
import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.openai_http import cached_tokens_of, excerpt, int_or_none, usage_int
from kvlab.probe.budget import Allowance, unbounded
from kvlab.probe.client import HTTPStatusError, ProbeClient
from kvlab.probe.material import sub_nonce, words
from kvlab.probe.progress import Tick, no_tick

START_TOKENS = 16
SEARCH_TOKENS = 2048  # the search's own bound where the server names no context, or a longer one
RESERVE = 32  # tokens kept free at the context's end: a prompt's ending and the tokens it generates
BLOCKS = 2  # a sized prompt fills at least this many blocks
REFINE_STEPS = 8  # extra lengths that tell the block sizes consistent with the reports apart
SCREEN_PAIRS, CONFIRM_PAIRS = 2, 4
STEP_RATIO = 0.8  # TTFT: a hit's median at most this fraction of a miss's
GUESS_CHARS_PER_TOKEN = 4.0  # before the server has counted a prompt (and where it never does)
CONFIRM_TOKENS = 256  # the timing prefixes when no hit was found: two of vLLM's 128-token CPU blocks
CONTEXT_ERROR = re.compile(
    r"(?:maximum context length|context (?:length|size|window)|max_model_len)\D{0,40}(\d+)", re.I
)


@dataclass
class Sample:
    tokens: int  # of the cached prefix (as the server counted it, else estimated)
    chars: int
    cached: int | None = None  # what its other ending reported; None: not reported (TTFT samples)
    hit_ms: list[float] = field(default_factory=list)  # TTFT samples: the other ending, after the prefix
    miss_ms: list[float] = field(default_factory=list)  # and a fresh prefix of the same length
    step: bool = False  # TTFT: a clear step (see the module docstring)

    @property
    def hit(self) -> bool:
        return bool(self.cached) or self.step


@dataclass
class Granularity:
    channel: str  # cached_tokens | TTFT
    context: int | None = None  # the model's context in tokens, where the server says it
    context_source: str = ""  # where ``context`` comes from: /v1/models, or the refusal that named it
    bound: int = 0  # the longest prefix tried, in tokens
    bound_by: str = ""  # context | refusal | probe | time: why the search stopped growing
    time_bound: str = ""  # where the time budget stopped it: the length it would have tried next, and its cost
    search_tokens: int = SEARCH_TOKENS  # the search's own bound (the probe's --search-tokens)
    chars_per_token: float = GUESS_CHARS_PER_TOKEN  # of the probe's word texts, as the server counted them
    tokens_counted: bool = False  # False: token counts are estimates (the server reported none)
    block: int | None = None  # the cache's block in tokens (1: per token); None: not determined
    candidates: list[int] = field(default_factory=list)  # block sizes consistent with every cached_tokens report
    first_hit: int | None = None  # tokens of the shortest prefix that showed a hit
    last_miss: int | None = None  # tokens of the longest prefix below it that did not
    samples: list[Sample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    filled: dict[str, int] = field(default_factory=dict)  # burst groups given a shared preamble: its characters

    @property
    def found(self) -> bool:
        return self.first_hit is not None

    @property
    def no_cache(self) -> bool:
        """No hit up to the model's whole context: no prompt it accepts could show one."""
        return not self.found and self.bound_by == "context"

    @property
    def blind(self) -> str:
        """Why a non-detection proves nothing ("" when it can): no hit up to a bound short of the context."""
        if self.found or self.no_cache:
            return ""
        return (
            f"not measured: no cache hit found for prompts up to {self.bound} tokens; the server may not cache, "
            f"or its blocks are larger ({self.bound_reason()})"
        )

    @property
    def limit(self) -> int | None:
        """The longest prefix a prompt may have, in tokens (None: the server named no context)."""
        return None if self.context is None else max(self.context - RESERVE, 1)

    def bound_reason(self) -> str:
        if self.bound_by == "context":
            return f"max_model_len {self.context}, from {self.context_source}"
        if self.bound_by == "refusal":
            return "the server refused the next length and named no context"
        if self.bound_by == "time":
            return f"the time budget: {self.time_bound}; --max-seconds searches further"
        if self.context is not None:
            return (
                f"the search's bound of {self.search_tokens} tokens, short of max_model_len {self.context}: "
                "--search-tokens searches further"
            )
        return (
            f"the probe's own bound of {self.search_tokens} tokens: the server names no max_model_len in "
            "/v1/models (--search-tokens searches further)"
        )

    def prompt_tokens(self) -> int:
        """Tokens a prefix needs for a hit on it to show: ``BLOCKS`` blocks and a margin (the block is known
        only up to the first hit's length where TTFT found it), within the context; ``CONFIRM_TOKENS`` when no
        hit was found."""
        unit = self.block or self.first_hit
        want = BLOCKS * unit + max(8, unit // 4) if unit else CONFIRM_TOKENS
        return want if self.limit is None else min(want, self.limit)

    def chars_for(self, tokens: int) -> int:
        """Characters of the probe's word texts that make at least ``tokens`` tokens (a 10% margin)."""
        return math.ceil(tokens * self.chars_per_token * 1.1)

    def prompt_chars(self, floor: int) -> int:
        """A prefix length in characters: ``prompt_tokens`` worth, at least ``floor`` (the probe's own minimum),
        at most the context."""
        chars = max(floor, self.chars_for(self.prompt_tokens()))
        if self.limit is not None:
            chars = min(chars, max(int(self.limit * self.chars_per_token * 0.95), 32))
        return chars

    def preamble(self, prompts: Sequence[str], seed: str) -> str:
        """Words for every prompt of a burst group to carry after its nonce tag where what the prompts share
        does not fill one block (on vLLM's CPU build no two of a group's prompts would share a block, and the
        bursts could not show a cache that mixes them): ``BLOCKS`` blocks' worth, whole blocks exactly for a
        byte-level tokenizer. "" where they share a block already (kvlab: the 16-character tag fills one), or
        no hit was found. Shared bytes count as tokens at the measured rate: a byte-level tokenizer's count,
        more than a BPE one's, so a group is never left short."""
        unit = self.block or self.first_hit
        if not unit or not prompts:
            return ""
        encoded = [p.encode() for p in prompts]
        shared = next((i for i, column in enumerate(zip(*encoded, strict=False)) if len(set(column)) > 1), None)
        shared = min(len(e) for e in encoded) if shared is None else shared
        if shared / self.chars_per_token >= unit:
            return ""
        chars = BLOCKS * unit if self.chars_per_token == 1 else self.chars_for(BLOCKS * unit)
        if self.limit is not None:  # room for the prompt itself and its answer
            chars = min(chars, int(self.limit * self.chars_per_token * 0.8) - max(len(p) for p in prompts))
        return words(random.Random(seed), chars - 1) + " " if chars > 1 else ""

    def summary(self) -> str:
        counted = "" if self.tokens_counted else " (token counts estimated: the server reports none)"
        if not self.found:
            if self.no_cache:
                return (
                    f"no cache hit for prompts up to {self.bound} tokens, the model's whole context "
                    f"({self.bound_reason()}), by {self.channel}: the server keeps no prefix cache its clients can "
                    f"see{counted}"
                )
            return self.blind + counted
        below = f", none at {self.last_miss}" if self.last_miss else ""
        if self.channel == "TTFT":
            return (
                f"TTFT steps from a {self.first_hit}-token prefix{below}: blocks of at most {self.first_hit} tokens "
                f"(cached_tokens not usable){counted}"
            )
        if self.block == 1:
            size = "per token (cached_tokens counts every cached token)"
        elif self.block is not None and len(self.candidates) <= 1:
            size = f"blocks of {self.block} tokens"
        elif self.block is not None:
            size = f"blocks of {' or '.join(map(str, self.candidates))} tokens (taken as {self.block})"
        else:
            size = f"irregular cached_tokens reports (taken as blocks of up to {self.first_hit} tokens)"
        return f"{size}: cached_tokens shows a hit from a {self.first_hit}-token prefix{below}{counted}"

    def sizing(self, what: str, chars: int) -> str:
        """One line saying how a kind of prompt was sized."""
        tokens = round(chars / self.chars_per_token)
        unit = self.block or self.first_hit
        blocks = f", {tokens / unit:.1f} blocks" if unit else ""
        return f"{what}: {chars} characters (~{tokens} tokens{blocks})"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fits(block: int, s: Sample, slack: bool = False) -> bool:
    """Does ``s``'s report follow blocks of ``block`` tokens: its common prefix floored to whole blocks (with
    ``slack``, one token shorter too: a tokenizer may merge the prefix's last token with the next)?"""
    if s.cached is None:
        return True
    floors = {s.tokens // block * block}
    if slack:
        floors.add(max(s.tokens - 1, 0) // block * block)
    return s.cached in floors


def block_candidates(samples: list[Sample]) -> tuple[list[int], bool]:
    """The block sizes every report is consistent with, smallest first, and whether one-token slack was
    needed (no exact fit: ``extract.infer_granularity``'s rule fails for every candidate)."""
    counted = [s for s in samples if s.cached is not None]
    hits = [s.cached for s in counted if s.cached]
    if not hits:
        return [], False
    g = math.gcd(*hits)
    exact = [d for d in divisors(g) if all(fits(d, s) for s in counted)]
    if exact:
        return exact, False
    return [d for d in divisors(g) if all(fits(d, s, slack=True) for s in counted)], True


def telling_length(candidates: list[int], hit: int) -> int:
    """A prefix length whose report tells the lower half of ``candidates`` from the upper: a whole number of
    the upper half's smallest block, plus the lower half's largest."""
    mid = (len(candidates) - 1) // 2
    lo, hi = candidates[mid], candidates[mid + 1]
    return hi * max(1, hit // hi) + lo


def context_length(client: ProbeClient) -> int | None:
    """``max_model_len`` (or ``context_length``) of the model's entry in ``GET /v1/models``; None if not said."""
    status, body = client.get("/v1/models")
    if status != 200:
        return None
    try:
        data: Any = json.loads(body)
    except ValueError:
        return None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    cards = [e for e in entries if isinstance(e, dict)]
    card = next((e for e in cards if e.get("id") == client.model), cards[0] if cards else None)
    for key in ("max_model_len", "context_length"):
        value = int_or_none(card.get(key)) if card else None
        if value is not None and value > 0:
            return value
    return None


class _Search:
    """The search's traffic: fresh word texts (from the nonce), counted as the server counts them."""

    def __init__(
        self, client: ProbeClient, nonce: str, report: Granularity, on_step: Tick, allowance: Allowance
    ) -> None:
        self.client, self.nonce, self.g, self.on_step = client, nonce, report, on_step
        self.allowance = allowance
        self.last_seconds = 0.0  # what the last length measured took
        self.rng = random.Random(f"granularity-{nonce}")
        self.order = random.Random(f"granularity-order-{nonce}")
        self.count = 0

    def fresh(self, kind: str, chars: int) -> str:
        """A new prefix; cached prefixes start with "g", the TTFT misses with "m" (no shared first token)."""
        self.count += 1
        head = f"{kind}{sub_nonce(self.nonce, f'granularity-{self.count}')} "
        return head + words(self.rng, max(chars - len(head), 1))

    def chars(self, tokens: int) -> int:
        return max(round(tokens * self.g.chars_per_token), 24)

    def tokens_of(self, prompt: str, data: dict[str, Any]) -> int:
        """The prompt's token count as the server reported it (its /tokenize, where usage says nothing), and
        the characters per token updated from it; an estimate where the server says neither."""
        n = usage_int(data, "prompt_tokens")
        if n is None and self.client.tokenize_body is not None:
            ids = self.client.tokenize(prompt)
            n = None if ids is None else len(ids)
        if n is None or n <= 0:
            return max(round(len(prompt) / self.g.chars_per_token), 1)
        self.g.tokens_counted = True
        self.g.chars_per_token = len(prompt) / n
        return n

    def warm(self, prefix: str) -> int:
        """Send ``prefix`` twice (2 tokens each) and return its token count."""
        data, _ = self.client.completion(prefix, 2)
        self.client.completion(prefix, 2)
        return self.tokens_of(prefix, data)

    def cached_sample(self, target: int) -> Sample:
        prefix = self.fresh("g", self.chars(target))
        n = self.warm(prefix)
        data, _ = self.client.completion(prefix + " B", 1)
        return Sample(n, len(prefix), cached_tokens_of(data))

    def ttft_pairs(self, s: Sample, target: int, pairs: int) -> None:
        for _ in range(pairs):
            prefix = self.fresh("g", self.chars(target))
            n = self.warm(prefix)
            s.tokens, s.chars = n, len(prefix)
            miss = self.fresh("m", len(prefix))
            for arm in self.order.sample(["hit", "miss"], 2):
                _, seconds = self.client.completion((prefix if arm == "hit" else miss) + " B", 1)
                (s.hit_ms if arm == "hit" else s.miss_ms).append(1000 * seconds)

    def ttft_sample(self, target: int) -> Sample:
        s = Sample(0, 0)
        self.ttft_pairs(s, target, SCREEN_PAIRS)
        if step(s.hit_ms, s.miss_ms):
            confirm = Sample(0, 0)
            self.ttft_pairs(confirm, target, CONFIRM_PAIRS)
            s.hit_ms += confirm.hit_ms
            s.miss_ms += confirm.miss_ms
            s.step = step(confirm.hit_ms, confirm.miss_ms)
        return s

    def sample(self, target: int, channel: str) -> Sample | None:
        """One length measured; None when the server refused it (the bound: the context, where it names it)."""
        began = self.allowance.clock()
        try:
            s = self.cached_sample(target) if channel == "cached_tokens" else self.ttft_sample(target)
        except HTTPStatusError as exc:
            if not 400 <= exc.status < 500:
                raise
            m = CONTEXT_ERROR.search(exc.body)
            if m and self.g.context is None:
                self.g.context, self.g.context_source = int(m.group(1)), f"its refusal ({excerpt(exc.body)[:120]!r})"
            else:
                self.g.notes.append(f"a prefix of ~{target} tokens was refused: {exc}")
            return None
        self.last_seconds = self.allowance.clock() - began
        self.g.samples.append(s)
        self.g.bound = max(self.g.bound, s.tokens)
        self.on_step()
        return s

    def affords(self, target: int, last: Sample) -> bool:
        """Whether a length of ``target`` tokens fits the allowance, its cost the last length's scaled by
        the prompt's length (a prefill's cost grows at least linearly); the stop recorded where it does not."""
        estimate = self.last_seconds * target / max(last.tokens, 1)
        if self.allowance.fits(estimate):
            return True
        self.g.bound_by = "time"
        self.g.time_bound = (
            f"~{target} tokens next, ~{estimate:.2g} s at the pace of {last.tokens} tokens in "
            f"{self.last_seconds:.2g} s, past the search's share ({max(self.allowance.left(), 0):.2g} s left)"
        )
        return False

    def grow(self, channel: str) -> Sample | None:
        """The growth phase: the first sample that hits, or None (``bound_by`` says why it stopped)."""
        target, retried = START_TOKENS, False
        while True:
            whole = self.g.limit is not None and self.g.limit <= self.g.search_tokens
            limit = self.g.limit if whole and self.g.limit is not None else self.g.search_tokens
            target = min(target, limit)
            s = self.sample(target, channel)
            if s is None:
                if self.g.limit is not None and not retried and target > self.g.limit * 0.9:
                    target, retried = int(self.g.limit * 0.9), True  # a context the refusal named: its top
                    continue
                self.g.bound_by = "context" if self.g.limit is not None and retried else "refusal"
                return None
            if s.hit:
                return s
            if target >= limit or s.tokens >= limit * 0.9:
                self.g.bound_by = "context" if whole else "probe"
                return None
            self.g.last_miss = s.tokens
            target = max(2 * s.tokens, target + 1)
            if not self.affords(min(target, limit), s):
                return None

    def refine(self, hit: Sample) -> None:
        """Lengths that tell the consistent block sizes apart, until one is left (or the steps run out)."""
        for _ in range(REFINE_STEPS):
            cands, _ = block_candidates(self.g.samples)
            if len(cands) <= 1:
                break
            if self.sample(telling_length(cands, hit.tokens), "cached_tokens") is None:
                break
        cands, slack = block_candidates(self.g.samples)
        self.g.candidates = cands
        # The largest consistent size: with an exact fit that is extract.infer_granularity's own answer (the
        # hits' gcd, which fits every report and divides none of the larger sizes).
        self.g.block = max(cands) if cands else None
        if slack and cands:
            self.g.notes.append("cached_tokens fits whole blocks only with one token of slack (a tokenizer merge)")
        misses = [s.tokens for s in self.g.samples if not s.cached and s.tokens < hit.tokens]
        self.g.last_miss = max(misses, default=None)
        self.g.first_hit = min(s.tokens for s in self.g.samples if s.cached)


def step(hits: list[float], misses: list[float]) -> bool:
    """A clear TTFT step: every hit faster than every miss, and the medians at most ``STEP_RATIO`` apart."""
    if not hits or not misses:
        return False
    return max(hits) < min(misses) and statistics.median(hits) <= STEP_RATIO * statistics.median(misses)


def search_requests(search_tokens: int, ttft: bool) -> int:
    """The most requests ``measure_granularity`` sends with this bound: every length by cached_tokens and its
    refinement, and (``ttft``) every length again by TTFT with the confirmation at the last (``Probe plan``)."""
    lengths = math.ceil(math.log2(max(search_tokens, START_TOKENS) / START_TOKENS)) + 1
    cached = 3 * (lengths + REFINE_STEPS)
    by_ttft = 4 * (SCREEN_PAIRS * lengths + CONFIRM_PAIRS) if ttft else 0
    return cached + by_ttft


def measure_granularity(
    client: ProbeClient,
    nonce: str,
    *,
    cached_tokens: bool,
    ttft: bool = True,
    on_step: Tick = no_tick,
    search_tokens: int = SEARCH_TOKENS,
    allowance: Allowance | None = None,
) -> Granularity | None:
    """The server's cache granularity, by cached_tokens where it is reported, else (``ttft``) by TTFT; None
    where neither may be used. ``on_step`` after every length measured; ``search_tokens``: the longest prefix
    tried where the model's context is longer (or unknown); ``allowance``: the search's share of the time
    budget (a length that would end past it is not tried: ``bound_by`` "time")."""
    if not cached_tokens and not ttft:
        return None
    g = Granularity("cached_tokens" if cached_tokens else "TTFT", search_tokens=search_tokens)
    g.context = context_length(client)
    g.context_source = "/v1/models" if g.context is not None else ""
    search = _Search(client, nonce, g, on_step, allowance or unbounded("granularity"))
    hit = search.grow(g.channel)
    if hit is not None and g.channel == "cached_tokens":
        search.refine(hit)
        return g
    if hit is None and g.channel == "cached_tokens" and ttft:
        # Reported, and 0 throughout: a server may report 0 and still cache. TTFT at the longest length.
        longest = max(g.samples, key=lambda s: s.tokens, default=None)
        s = search.sample(longest.tokens, "TTFT") if longest is not None else None
        if s is not None and s.step:
            g.notes.append(f"cached_tokens reported no hit up to {g.bound} tokens, but TTFT steps at {s.tokens}")
            g.channel, g.samples = "TTFT", [s]
            hit = search.grow("TTFT")
    if hit is not None:
        g.first_hit = hit.tokens
    return g
