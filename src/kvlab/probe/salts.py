"""What does the server do with a ``cache_salt``? Honour it, ignore it, or reject the request?

- *rejected*: a request with the field is refused (transformers' server: 422 on any unknown field). The
  probe carries on without salts (its references are then plain sequential requests).
- *honoured*: the same prompt under another salt does not hit what the first salt cached.
- *ignored*: accepted, and still a hit across salts (llama.cpp accepts any field). That is a leak: a client
  that relies on a salt to keep its prompts apart is not protected.

Seen through ``cached_tokens`` where the server reports it (this module: a few requests), otherwise
through TTFT (``timing``, unless ``--no-timing``). The warm-up request generates 2 tokens and is sent twice, so
caches that skip 1-token requests or admit a prompt only on its second sighting still register it. The
prompt must fill the server's cache blocks, or no salt can show anything (a 300-character prompt never fills
one of vLLM's 128-token CPU blocks): the probe sizes it from the granularity it measured first
(``granularity``), and where no hit was found at all the check is not run (``not_measured``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvlab.openai_http import cached_tokens_of
from kvlab.probe.client import ProbeClient, SaltAcceptance
from kvlab.probe.material import TAG_CHARS, sub_nonce, tag, words

SALT_PROMPT_CHARS = 300
MIN_VISIBLE_HIT = 8  # cached tokens under the same salt for the check to say anything


@dataclass
class SaltFinding:
    handling: str  # honoured | ignored | rejected | undetermined
    channel: str = ""  # cached_tokens | TTFT | the refusal
    detail: str = ""
    same_salt_cached: int | None = None
    other_salt_cached: int | None = None
    prompt_chars: int | None = None  # the check's prompt (None: not sent)

    @property
    def verdict(self) -> str:
        return {"ignored": "leak", "honoured": "clean", "rejected": "info"}.get(self.handling, "not measured")


def rejected(acceptance: SaltAcceptance) -> SaltFinding:
    return SaltFinding(
        "rejected",
        "refusal",
        f"POST {acceptance.url} answered {acceptance.status} to a request carrying cache_salt "
        f"({acceptance.message[:160]!r}); the probe carries on without salts",
    )


def not_measured(why: str) -> SaltFinding:
    """No check: ``why`` (the granularity search found no hit, so no prompt could show a salt's effect)."""
    return SaltFinding("undetermined", "cached_tokens", why)


def check_with_cached_tokens(client: ProbeClient, nonce: str, prompt_chars: int = SALT_PROMPT_CHARS) -> SaltFinding:
    """Cache a fresh prompt under salt 1, then ask with salt 1 (the control) and salt 2 (the test). The prompt
    is ``prompt_chars`` long (sized to fill the server's blocks: ``granularity.Granularity.prompt_chars``)."""
    n = sub_nonce(nonce, "salts")
    prefix = tag(n, words(random.Random(f"salts-{n}"), max(prompt_chars - TAG_CHARS, 1)))
    s1, s2 = f"probe-a-{n}", f"probe-b-{n}"
    for _ in range(2):
        client.completion(prefix + " A", 2, salt=s1)
    same = cached_tokens_of(client.completion(prefix + " B", 1, salt=s1)[0])
    other = cached_tokens_of(client.completion(prefix + " C", 1, salt=s2)[0])
    found = SaltFinding("undetermined", "cached_tokens", "", same, other, len(prefix))
    if same is None or other is None:
        found.detail = "cached_tokens is not reported for these requests"
    elif same < MIN_VISIBLE_HIT:
        found.detail = (
            f"no hit visible in cached_tokens even under the same salt ({same} cached, {len(prefix)}-character prompt)"
        )
    elif other * 2 >= same:
        found.handling = "ignored"
        found.detail = f"the same prompt under another salt hit {other} cached tokens (same salt: {same})"
    else:
        found.handling = "honoured"
        found.detail = f"the same prompt under another salt hit {other} cached tokens, under the same salt {same}"
    return found


def from_timing(handling: str | None) -> SaltFinding | None:
    """The finding the TTFT measurement supports, if any (see ``TimingReport.salt_handling``)."""
    if handling == "ignored":
        return SaltFinding(handling, "TTFT", "a cache hit shows in TTFT across distinct salts")
    if handling == "honoured":
        return SaltFinding(handling, "TTFT", "a cache hit shows in TTFT without salts, never across distinct salts")
    return None
