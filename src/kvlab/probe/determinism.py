"""How deterministic is the server on its own? The yardstick for "this answer changed because of another request".

An answer that differs from its reference under cross-traffic is evidence of shared state only if the
server gives the same answer whenever other prompts are *not* involved. Two controls, with no foreign text
anywhere near the prompt:

- alone, repeated: the prompt sent again, one request at a time (its own cache entries may be hit: the
  server's legitimate prefix caching is part of what is measured);
- a burst of copies of itself: the prompt sent ``copies`` times concurrently (batching, no foreign text);
- where the server accepts ``cache_salt``: the same burst with a salt of its own for every copy, so that the
  copies are batched together but (on a server that honours salts) share no cache entry.

On a server shown deterministic alone and in either burst, a divergent answer under cross-traffic counts:
with salted copies the control is batching alone, which tells a cache whose sharers corrupt each other
(copies of one prompt too, as without copy-on-write) from a server whose batched arithmetic varies (its
salted copies vary as well). On another one, answers must change under cross-traffic significantly more
often than copies do in bursts of themselves (the control with the same concurrency; one-sided Fisher test,
``report.RATE_ALPHA``), else the probe says "inconclusive" and reports this measured variance.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvlab.probe.budget import Allowance
from kvlab.probe.client import Answer, ProbeClient

MAX_EXAMPLES = 10


@dataclass(frozen=True)
class Request:
    prompt: str
    chat: bool = False
    salt: str | None = None


def burst(
    client: ProbeClient, requests: Sequence[Request], max_tokens: int, stagger: float, rng: random.Random
) -> list[Answer | None]:
    """Send ``requests`` concurrently, arrivals spread over ``stagger`` seconds in order (so later ones can find
    the earlier ones' prefixes cached); the answers in the same order, None for a request that gave up after
    its retries (dropped: the caller measures the others)."""
    delays = sorted(rng.uniform(0, stagger) for _ in requests)

    def one(req: Request, delay: float) -> Answer | None:
        time.sleep(delay)
        return client.try_complete(req.prompt, max_tokens, req.chat, req.salt)

    with ThreadPoolExecutor(max_workers=max(1, len(requests))) as pool:
        futures = [pool.submit(one, r, d) for r, d in zip(requests, delays, strict=True)]
        return [f.result() for f in futures]


@dataclass
class Difference:
    """One answer that differed from its prompt's reference, with both (the evidence behind a verdict)."""

    prompt: str
    condition: str  # alone | burst of copies | after the victim | ...
    reference: str
    answer: str
    reference_ids: list[int] | None = None
    answer_ids: list[int] | None = None

    @classmethod
    def of(cls, prompt: str, condition: str, ref: Answer, ans: Answer) -> Difference:
        ids = (list(ref.token_ids) if ref.token_ids is not None else None, ans.token_ids)
        return cls(prompt, condition, ref.text, ans.text, ids[0], list(ids[1]) if ids[1] is not None else None)


@dataclass
class Determinism:
    prompts: int = 0
    alone: int = 0
    alone_differ: int = 0
    burst: int = 0
    burst_differ: int = 0
    salted: int = 0  # copies in bursts under a salt each (0: the server takes no salts)
    salted_differ: int = 0
    most_distinct: int = 0  # the most distinct answers one prompt gave (1 = always the same)
    examples: list[Difference] = field(default_factory=list)
    dropped: int = 0  # requests that gave up after their retries: not counted above
    left_out: int = 0  # prompts not measured: the time budget ran out (``budget``)

    @property
    def alone_deterministic(self) -> bool:
        return self.alone > 0 and self.alone_differ == 0

    @property
    def deterministic(self) -> bool:
        return self.alone_deterministic and self.burst > 0 and self.burst_differ == 0

    @property
    def batch_deterministic(self) -> bool:
        """The same answer alone and batched with copies under salts of their own: batching changes nothing."""
        return self.alone_deterministic and self.salted > 0 and self.salted_differ == 0

    def variance(self) -> str:
        salted = f", {self.salted_differ} of {self.salted} under a salt each" if self.salted else ""
        return (
            f"{self.alone_differ} of {self.alone} repeats alone and {self.burst_differ} of {self.burst} copies in "
            f"bursts of themselves{salted} differed from the prompt's first answer ({self.prompts} prompts; up to "
            f"{self.most_distinct} distinct answers for one prompt"
            + (f"; {self.left_out} more left out for the time budget" if self.left_out else "")
            + ")"
        )


def measure(
    client: ProbeClient,
    items: Sequence[tuple[Request, Answer]],
    *,
    repeats: int,
    copies: int,
    max_tokens: int,
    stagger: float,
    rng: random.Random,
    salt: Callable[[str], str] | None = None,
    on_item: Callable[[], None] | None = None,
    allowance: Allowance | None = None,
) -> Determinism:
    """Each (request, its reference) alone ``repeats`` more times, then in a burst of ``copies`` of itself, and
    with ``salt`` (label -> a salt no other request uses) in a burst of ``copies`` under a salt each;
    ``on_item`` is called after each request's measurements (the probe's progress); ``allowance``: the
    phase's share of the time budget (the items it cannot afford are left out, counted in ``left_out``)."""
    out = Determinism(prompts=len(items))
    for i, (req, ref) in enumerate(items):
        if allowance is not None and not allowance.affords(i):
            out.prompts, out.left_out = i, len(items) - i
            break
        seen = Counter([ref.key()])
        alone = [client.try_complete(req.prompt, max_tokens, req.chat) for _ in range(repeats)]
        copies_answers = burst(client, [Request(req.prompt, req.chat)] * copies, max_tokens, stagger, rng)
        salted = [Request(req.prompt, req.chat, salt(f"copy-{i}-{k}")) for k in range(copies)] if salt else []
        salted_answers = burst(client, salted, max_tokens, stagger, rng) if salted else []
        conditions = (("alone", alone), ("burst of copies", copies_answers), ("salted copies", salted_answers))
        for condition, answers in conditions:
            for ans in answers:
                if ans is None:  # gave up after its retries: measured without it
                    out.dropped += 1
                    continue
                seen[ans.key()] += 1
                differs = ans.key() != ref.key()
                if condition == "alone":
                    out.alone += 1
                    out.alone_differ += differs
                elif condition == "burst of copies":
                    out.burst += 1
                    out.burst_differ += differs
                else:
                    out.salted += 1
                    out.salted_differ += differs
                if differs and len(out.examples) < MAX_EXAMPLES:
                    out.examples.append(Difference.of(req.prompt, condition, ref, ans))
        out.most_distinct = max(out.most_distinct, len(seen))
        if on_item is not None:
            on_item()
    return out
