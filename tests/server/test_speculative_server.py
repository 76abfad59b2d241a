"""``kvlab serve --speculative-config``: greedy answers through the official ``openai`` client are the plain
server's, vLLM's ``vllm:spec_decode_*`` counters count the drafts, and a tenant's drafts never reach another's
cache: the drafter reads one request's own tokens, and a rejected draft is never findable."""

from __future__ import annotations

import random

import openai

from kvlab.config import SpeculativeConfig
from server.server_http import http_of, start

KEYS = {"key-a": "a", "key-b": "b"}
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)


def repetitive(seed: int) -> list[int]:
    rng = random.Random(seed)
    unit = [rng.randrange(256) for _ in range(5)]
    return unit * 6


def complete(srv, key: str, prompt: list[int]) -> tuple[str, int]:
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, timeout=60, max_retries=0)
    out = client.completions.create(model="mini", prompt=prompt, max_tokens=20, temperature=0)
    usage = out.usage
    assert usage is not None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return out.choices[0].text, cached or 0


def test_speculative_answers_are_the_plain_server_s_and_counted_as_vllm_counts() -> None:
    prompts = [repetitive(s) for s in (3, 4, 5)]
    plain, spec = start(api_keys=KEYS), start(api_keys=KEYS, scheduler={"speculative": SPEC})
    try:
        want = [complete(plain, "key-a", p)[0] for p in prompts]
        got = [complete(spec, "key-a", p)[0] for p in prompts]
        assert got == want
        # The same prompts again: tenant a finds its own cached blocks (what a draft left unverified is not among
        # them, or the answers above would differ), tenant b finds nothing of tenant a's.
        assert all(complete(spec, "key-a", p)[1] >= 16 for p in prompts)
        assert [complete(spec, "key-b", p)[1] for p in prompts] == [0, 0, 0]
        families = {f.name: f for f in http_of(spec).metric_families()}
        value = {n: families[f"vllm:spec_decode_{n}"].samples[0].value for n in ("num_drafts", "num_draft_tokens",
                                                                                  "num_accepted_tokens")}  # fmt: skip
        assert value["num_drafts"] > 0 and 0 < value["num_accepted_tokens"] <= value["num_draft_tokens"]
        per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
        assert [s.labels["position"] for s in per_pos] == ["0", "1", "2", "3"]
        assert sum(s.value for s in per_pos) == value["num_accepted_tokens"]
        assert {s.labels["engine"] for s in per_pos} == {"0"}
        assert not any(f.startswith("vllm:spec_decode") for f in {f.name for f in http_of(plain).metric_families()})
    finally:
        plain.stop()
        spec.stop()
