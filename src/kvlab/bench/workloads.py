"""The benchmarks' prompt sets, built from a model's tokenizer so every engine gets the same token ids:


* ``shared-prefix``, W<N>: N requests sharing a ~100-token system prompt, each with its own question;
* ``no-sharing``: 32 distinct ~200-token prompts with no common prefix (plain text, no chat template);
* ``long-context``: 8 requests over one ~2,000-token document, each with its own question after it
  (prefill-bound; the document is cut to fit a model with fewer positions, and the table says so);
* ``chat``: 8 sessions x 4 turns, issued in rounds (a round starts when the previous one is done, on the same
  engine): turn k's prompt is turn k-1's prompt + a scripted assistant answer + the next user message, so every
  engine gets the same prompts and its prefix cache can reuse the whole earlier prompt;
* ``parallel``: W16's prompts with n = 4 samples each, at temperature 1 with top_k 1, which can only draw the
  argmax (the greedy tokens, so they compare across engines; vLLM refuses n > 1 at temperature 0): kvlab forks
  the samples after the prompt (shared blocks, copy on write), vLLM shares their prompt blocks.

Every study draws from here (throughput, serve, fidelity, cow, sweep).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.bench.names import THROUGHPUT_WORKLOADS
from kvlab.model.loader import LoadedModel

SYSTEM_PROMPT = (
    "You are a careful assistant for a travel agency. Answer in two short sentences, in plain English, "
    "without lists or headings. Mention prices only when the customer asks for them, never invent a "
    "booking reference, and if a question is about visas or health rules, tell the customer to check "
    "the official government website of the country they are travelling to before they book anything."
)
QUESTIONS = [
    "Which month is best to visit Lisbon?",
    "Can I bring my cat on a train to Vienna?",
    "What should I pack for Iceland in March?",
    "Is Kyoto crowded in April?",
    "How do I get from Rome to Naples?",
    "Do I need cash in Stockholm?",
    "What is a good day trip from Madrid?",
    "Is Prague walkable?",
    "Where can I see the northern lights?",
    "How early should I arrive for a ferry to Corsica?",
    "What is the weather like in Crete in May?",
    "Can children visit the Louvre for free?",
    "Is Budapest good for a weekend?",
    "What food should I try in Bologna?",
    "How long is the hike to Machu Picchu?",
    "Are trains in Switzerland expensive?",
]


def shared_prefix_prompts(loaded: LoadedModel, n: int, seed: int = 0) -> list[list[int]]:
    """N prompts: one shared ~100-token system prompt + a distinct question each."""
    tok = loaded.tokenizer
    if loaded.config.vocab_size <= 512:  # byte-level mini: random bytes, 100 shared + 8-24 distinct
        rng = random.Random(seed)
        system = [rng.randrange(256) for _ in range(100)]
        return [system + [rng.randrange(256) for _ in range(rng.randint(8, 24))] for _ in range(n)]
    prompts = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (case {i})")
        text = tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}])
        prompts.append(tok.encode(text))
    return prompts


# The other workloads' texts for a real tokenizer (the byte-level mini draws random bytes instead, as W<N>
# does): the places and months their sentences are drawn from, the chat's follow-up questions and the scripted
# assistant answers every engine is given in place of its own (so that every engine gets the same prompts).
CITIES = (
    "Lisbon", "Vienna", "Reykjavik", "Kyoto", "Naples", "Stockholm", "Madrid", "Prague", "Tromso", "Ajaccio",
    "Heraklion", "Paris", "Budapest", "Bologna", "Cusco", "Zurich", "Porto", "Seville", "Krakow", "Dubrovnik",
    "Bergen", "Edinburgh", "Dublin", "Athens", "Split", "Valencia", "Munich", "Salzburg", "Ghent", "Tallinn",
    "Riga", "Palermo",
)  # fmt: skip
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
)  # fmt: skip
FOLLOW_UPS = (
    "And what would that cost for two people?",
    "Is that easy with two small children?",
    "What if it rains all day?",
    "Can I do that without a car?",
    "Which part of town should we stay in?",
    "How far ahead should I book it?",
    "Is there anything we should avoid?",
    "Could you say that again more briefly?",
)
ANSWERS = (
    "Late spring is usually the best time: the days are long and mild, the crowds are smaller than in summer, "
    "and the ferries and mountain trains already run their full timetable.",
    "Yes, that works well. The regional trains run every hour, the trip takes about three hours, and a seat "
    "booked a week ahead costs much less than one bought at the station.",
    "Pack layers rather than one heavy coat, good walking shoes and a rain jacket, because the weather can "
    "change several times in a single afternoon.",
    "It is busy around the main sights from ten until four, so start early or go in the evening, when the old "
    "town is quieter and the light is better for photographs.",
    "Most visitors stay near the old town: it is walkable, close to the station, and the small hotels there are "
    "often cheaper than the large ones by the river.",
    "Book the ferry and the first two nights in advance and keep the rest flexible; outside August there is "
    "almost always a room for the same evening.",
    "Cards are accepted nearly everywhere, even for a coffee, but keep a little cash for markets, buses in "
    "small villages and the toilets at some stations.",
    "Please check the official government website of the country before you book anything: the rules for "
    "visas and health papers change often and only that page is binding.",
)
LONG_CONTEXT_INTRO = "Here is a travel report."
LONG_CONTEXT_MARK = "\x00DOCUMENT\x00"  # where the document's token ids go in the rendered chat template


class WorkloadError(ValueError):
    """A workload cannot be built for this model as asked (the message says why)."""


def _plain_ids(tok: Any, text: str) -> list[int]:
    """The ids of ``text`` alone: no BOS/EOS added, as it goes after other tokens."""
    return tok.encode(text, add_special_tokens=False)


def _sentence(rng: random.Random) -> str:
    a, b = rng.sample(CITIES, 2)
    month = rng.choice(MONTHS)
    kind = rng.randrange(4)
    if kind == 0:
        part = rng.choice(("morning", "evening", "night", "coastal"))
        return (
            f"The {part} train from {a} to {b} leaves at {rng.randrange(5, 23)}:{rng.randrange(0, 60, 5):02d} and "
            f"takes {rng.randint(2, 9)} hours; a seat costs {rng.randint(19, 140)} euros in {month}."
        )
    if kind == 1:
        return (
            f"In {month} the afternoons in {a} reach {rng.randint(-5, 34)} degrees, and the museums of the old "
            f"town open at {rng.randint(8, 11)} in the morning."
        )
    if kind == 2:
        return (
            f"The ferry between {a} and {b} carried {rng.randint(120, 2400)} passengers on an average day last "
            f"{month}, and it is often full at weekends."
        )
    price, breakfast = rng.randint(60, 320), rng.choice(("included", "extra"))
    return f"Small hotels near the centre of {a} charge about {price} euros a night in {month}, breakfast {breakfast}."


def _text_ids(tok: Any, rng: random.Random, count: int, opener: str = "") -> list[int]:
    """Exactly ``count`` token ids of ``opener`` followed by sentences drawn from ``rng``."""
    text, ids = opener, _plain_ids(tok, opener) if opener else []
    while len(ids) < count:
        text += (" " if text else "") + _sentence(rng)
        ids = _plain_ids(tok, text)
    return ids[:count]


def _first_token(ids: list[int], bos: int | None) -> int:
    return ids[1] if len(ids) > 1 and ids[0] == bos else ids[0]


def no_sharing_prompts(loaded: LoadedModel, n: int = 32, tokens: int = 200, seed: int = 0) -> list[list[int]]:
    """N distinct prompts of exactly ``tokens`` tokens with no common prefix beyond a BOS: their first tokens
    differ (for N up to 256 on the mini, up to the 44 openers otherwise), so the prefix cache finds nothing.
    Plain text, no chat template: its header would be a prefix every prompt shares."""
    tok = loaded.tokenizer
    if loaded.config.vocab_size <= 512:  # byte-level mini: random bytes, distinct first bytes
        rng = random.Random(seed)
        firsts = rng.sample(range(256), min(n, 256))
        return [[firsts[i % len(firsts)]] + [rng.randrange(256) for _ in range(tokens - 1)] for i in range(n)]
    openers = (*CITIES, *MONTHS)
    prompts: list[list[int]] = []
    used: set[int] = set()
    for i in range(n):
        # Prompt i opens with the i-th place (or the next one whose first token no earlier prompt has).
        # Past the openers a first token repeats: the first try is kept.
        tries = (
            _text_ids(tok, random.Random(seed * 1_000_003 + i), tokens, f"{openers[(i + k) % len(openers)]}:")
            for k in range(len(openers))
        )
        first_try = next(tries)
        fresh = (t for t in itertools.chain([first_try], tries) if _first_token(t, tok.bos_token_id) not in used)
        ids = next(fresh, first_try)
        used.add(_first_token(ids, tok.bos_token_id))
        prompts.append(ids)
    return prompts


def long_context_parts(
    loaded: LoadedModel, n: int = 8, document_tokens: int = 2000, max_tokens: int = 32, seed: int = 0
) -> tuple[list[int], list[int], list[list[int]]]:
    """(head, document, tails) of the long-context prompts: prompt i is head + document + tails[i] (the
    document in a user message, question i after it). The document has ``document_tokens`` tokens, or fewer
    when the model's positions would not hold it with the longest question and ``max_tokens``."""
    tok, max_pos = loaded.tokenizer, loaded.config.max_position_embeddings
    rng = random.Random(seed)
    if loaded.config.vocab_size <= 512:  # byte-level mini: random bytes, a question of 8-24 each
        head: list[int] = []
        tails = [[rng.randrange(256) for _ in range(rng.randint(8, 24))] for _ in range(n)]
    else:
        head, tails = [], []
        for i in range(n):
            q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (case {i})")
            content = f"{LONG_CONTEXT_INTRO}\n\n{LONG_CONTEXT_MARK}\n\nQuestion: {q} Answer from the report only."
            before, after = tok.apply_chat_template([{"role": "user", "content": content}]).split(LONG_CONTEXT_MARK)
            head = tok.encode(before)  # the same for every question: it ends before the document
            tails.append(_plain_ids(tok, after))
    room = max_pos - max_tokens - len(head) - max(len(t) for t in tails)
    if room < 16:
        raise WorkloadError(
            f"long-context: {max_pos} positions leave {room} tokens for the document (fewer --max-tokens?)"
        )
    count = min(document_tokens, room)
    if loaded.config.vocab_size <= 512:
        return head, [rng.randrange(256) for _ in range(count)], tails
    return head, _text_ids(tok, rng, count), tails


def long_context_prompts(
    loaded: LoadedModel, n: int = 8, document_tokens: int = 2000, max_tokens: int = 32, seed: int = 0
) -> list[list[int]]:
    """N prompts over one document (``long_context_parts``), each with its own question after it."""
    head, doc, tails = long_context_parts(loaded, n, document_tokens, max_tokens, seed)
    return [head + doc + t for t in tails]


def chat_rounds(
    loaded: LoadedModel, sessions: int = 8, turns: int = 4, max_tokens: int = 32, seed: int = 0
) -> list[list[list[int]]]:
    """The chat workload's prompts, round by round: round k holds turn k of every session still going. Turn 0
    is the system prompt + the session's question; turn k is turn k-1's prompt + a scripted assistant answer +
    the next user message, so it extends turn k-1's prompt token for token. A session ends early when its next
    turn and ``max_tokens`` would not fit the model's positions. The scripted answers replace the engines' own,
    so every engine gets the same prompts (and no engine's output decides another's prompt)."""
    tok, max_pos = loaded.tokenizer, loaded.config.max_position_embeddings
    byte_level = loaded.config.vocab_size <= 512
    system = [random.Random(seed).randrange(256) for _ in range(100)]  # the mini's shared system prompt
    rounds: list[list[list[int]]] = [[] for _ in range(turns)]
    for s in range(sessions):
        rng = random.Random(seed * 1_000_003 + s + 1)
        prompt: list[int] = []
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        text = ""
        for t in range(turns):
            if byte_level:  # random bytes: a 32-byte answer, a user message of 8-24
                answer = [rng.randrange(256) for _ in range(32)] if t else []
                prompt = prompt + answer + [rng.randrange(256) for _ in range(rng.randint(8, 24))]
                if t == 0:
                    prompt = system + prompt
            else:
                if t:
                    messages.append({"role": "assistant", "content": ANSWERS[(s + t - 1) % len(ANSWERS)]})
                first = QUESTIONS[s % len(QUESTIONS)] + ("" if s < len(QUESTIONS) else f" (case {s})")
                messages.append({"role": "user", "content": FOLLOW_UPS[(3 * s + t) % len(FOLLOW_UPS)] if t else first})
                new_text = tok.apply_chat_template(messages)
                full = tok.encode(new_text)
                if full[: len(prompt)] != prompt:  # the tokens at the seam merged: extend the ids instead
                    if not new_text.startswith(text):
                        raise WorkloadError("chat: the template does not render a longer conversation as an extension")
                    full = prompt + _plain_ids(tok, new_text[len(text) :])
                prompt, text = full, new_text
            if len(prompt) + max_tokens > max_pos:
                break
            rounds[t].append(prompt)
    return [r for r in rounds if r]


@dataclass(frozen=True)
class WorkloadSizes:
    """How big the workloads besides W<N> are (W<N>'s sizes are ``compare_throughput``'s ``sizes``)."""

    distinct_requests: int = 32  # no-sharing: prompts
    distinct_tokens: int = 200  # no-sharing: tokens per prompt
    long_requests: int = 8  # long-context: questions over the document
    document_tokens: int = 2000  # long-context: the document (cut to the model's positions)
    sessions: int = 8  # chat: sessions
    turns: int = 4  # chat: turns per session (rounds)
    n: int = 4  # parallel: samples per prompt
    parallel_requests: int = 16  # parallel: W<N>'s prompts


@dataclass(frozen=True)
class Workload:
    """One workload as every engine runs it: ``rounds`` of prompts (token ids), a round's prompts submitted at
    once and a round only after the previous one finished, on the same engine (one round but for chat); ``n``
    samples per prompt. ``name`` labels its rows; ``note``: what the table says about it."""

    kind: str
    name: str
    rounds: list[list[list[int]]]
    n: int = 1
    note: str = ""

    @property
    def prompts(self) -> list[list[int]]:
        return [p for r in self.rounds for p in r]

    @property
    def temperature(self) -> float:
        """0 (greedy) for one sample; n > 1 samples at temperature 1 with top_k 1: the argmax again, by the
        sampling path (vLLM refuses n > 1 at temperature 0)."""
        return 0.0 if self.n == 1 else 1.0

    @property
    def top_k(self) -> int:
        return 0 if self.n == 1 else 1

    @property
    def seed(self) -> int | None:
        """Sampled runs are seeded: top_k 1 keeps every token tied at the top (frequent in bf16 logits), and the
        draw among ties must repeat from run to run."""
        return None if self.n == 1 else 0

    def peak(self) -> list[list[int]]:
        """Prompts standing for the most an engine holds at once, what it is sized for: as many as the largest
        round has sequences, each as long as the longest prompt."""
        return [max(self.prompts, key=len)] * (max(len(r) for r in self.rounds) * self.n)

    def warmup(self) -> Workload:
        """Two prompts of the first round, with the same sampling."""
        return Workload(self.kind, self.name, [self.rounds[0][:2]], self.n)


def as_workload(prompts: Sequence[list[int]] | Workload) -> Workload:
    """A workload as it is, or prompts as one greedy round (what the runners took before workloads)."""
    if isinstance(prompts, Workload):
        return prompts
    return Workload("shared-prefix", f"W{len(prompts)}", [[list(p) for p in prompts]])


def build_workloads(
    loaded: LoadedModel,
    kinds: Sequence[str],
    requests: Sequence[int],
    max_tokens: int,
    sizes: WorkloadSizes = WorkloadSizes(),
) -> list[Workload]:
    """The workloads of ``kinds`` in that order (``THROUGHPUT_WORKLOADS``; shared-prefix: W<N> for each N of
    ``requests``), each with its rows' label and note."""
    if bad := sorted(set(kinds) - set(THROUGHPUT_WORKLOADS)):
        raise WorkloadError(f"unknown workload(s) {bad}; known: {', '.join(THROUGHPUT_WORKLOADS)}")
    out: list[Workload] = []
    for kind in dict.fromkeys(kinds):
        if kind == "shared-prefix":
            out += [Workload(kind, f"W{n}", [shared_prefix_prompts(loaded, n)]) for n in requests]
        elif kind == "no-sharing":
            prompts = no_sharing_prompts(loaded, sizes.distinct_requests, sizes.distinct_tokens)
            out.append(Workload(kind, f"no-sharing {len(prompts)}x{sizes.distinct_tokens}", [prompts]))
        elif kind == "long-context":
            head, doc, tails = long_context_parts(loaded, sizes.long_requests, sizes.document_tokens, max_tokens)
            note = ""
            if len(doc) < sizes.document_tokens:
                note = (
                    f"long-context: the document is cut from {sizes.document_tokens} to {len(doc)} tokens, what "
                    f"{loaded.name}'s {loaded.config.max_position_embeddings} positions hold with a question and "
                    f"{max_tokens} output tokens"
                )
            rounds = [[head + doc + t for t in tails]]
            out.append(Workload(kind, f"long-context {len(tails)}x{len(doc)}", rounds, note=note))
        elif kind == "chat":
            rounds = chat_rounds(loaded, sizes.sessions, sizes.turns, max_tokens)
            ended = sizes.sessions * sizes.turns - sum(len(r) for r in rounds)
            note = (
                f"chat: {sizes.sessions} sessions x {sizes.turns} turns in rounds, a round once the last one is "
                "done, on the same engine; the sessions share W<N>'s system prompt, and turn k's prompt is turn "
                "k-1's + a scripted assistant answer + the next user message, for every engine the same: the "
                "prefix cache can reuse every earlier prompt (not the generated answer, which the script replaces); "
                "HF's peers keep nothing between rounds, llama.cpp only the prompt it ran last"
            ) + (f"; {ended} turns left out, past the model's positions" if ended else "")
            out.append(Workload(kind, f"chat {sizes.sessions}x{sizes.turns}", rounds, note=note))
        else:  # parallel
            n, k = sizes.n, sizes.parallel_requests
            note = (
                f"W{k} n={n}: W{k}'s prompts, {n} samples each at temperature 1 with top_k 1, the argmax (greedy "
                "tokens that compare across engines; vLLM refuses n > 1 at temperature 0); kvlab forks the "
                "samples after the prompt (shared blocks, copy on write), HF generates n copies of each prompt "
                "(num_return_sequences), llama.cpp runs each prompt n times in a row"
            )
            out.append(Workload(kind, f"W{k} n={n}", [shared_prefix_prompts(loaded, k)], n=n, note=note))
    return out
