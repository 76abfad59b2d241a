"""``kvlab bench serve``: the shared-prefix workload of ``kvlab bench throughput`` against any OpenAI-compatible
server, measured from the client as ``vllm bench serve`` measures it: the workload and its schedule here, the
streaming client in ``stream_client``, what is measured and its table in ``serve_results``.

What is sent. W<N> (``kvlab.bench.workloads.shared_prefix_prompts``) is the prompt set: N prompts sharing a
long prefix. A run sends ``num_prompts`` streaming ``POST /v1/completions`` requests (default N: each prompt
once); request k sends prompt k mod N, so more requests than prompts cycle through the set in order (each
prompt then meets its own earlier copies in the server's cache) and fewer take its first ones. Every request
is greedy (``temperature: 0``), ``max_tokens`` long, EOS ignored (``ignore_eos``, which vLLM, llama.cpp's server
and kvlab's accept), ``stream_options.include_usage`` so the last chunk carries the token count. The prompt is
the token-id list by default, so every server sees exactly the same tokens; ``prompt_format="text"`` sends the
decoded text for servers that refuse token lists.

When it is sent (vLLM's ``--request-rate`` and ``--max-concurrency``). ``request_rate`` infinite (the default)
sends every request at once; a finite rate makes the arrivals a Poisson process (``arrival_schedule``): the
first at 0, then exponential gaps of mean 1/rate drawn from ``random.Random(seed)``, so a seed gives the same
schedule on every run. (vLLM draws the gaps from numpy's global generator, starts with a gap instead of 0
and rescales the schedule so its last arrival falls at N/rate; kvlab keeps the draws as they are and reports
the schedule.) ``max_concurrency`` is a semaphore: a request whose turn came waits for a free slot, and its
client queue time (sent minus arrived) is reported apart, as vLLM's is.


With ``repeats``, every round follows the same schedule and the round with the shortest duration counts
(noise only ever adds time). Every round goes to the same server, so from the second round on its prefix
cache may already hold every prompt: the per-request ``cached_tokens`` (when the server reports them:
``usage.prompt_tokens_details`` or llama.cpp's ``timings.cache_n``, read by ``kvlab.openai_http``) show how much
each round reused.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.bench.serve_results import PROMPT_FORMATS, PromptFormat, ServeBench, ServeBenchResult
from kvlab.bench.stream_client import RoundSender
from kvlab.openai_http import ModelDiscoveryError, discover_model, server_root

if TYPE_CHECKING:
    from kvlab.model.loader import LoadedModel


class ServeBenchError(RuntimeError):
    """The benchmark cannot start (the server names no model, say); the message names the URL asked."""


@dataclass(frozen=True)
class Workload:
    """W<N>: its prompts as token ids, and as text for servers that take only text."""

    name: str
    token_ids: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]

    def prompts(self, prompt_format: PromptFormat) -> list[list[int] | str]:
        if prompt_format == "text":
            return list(self.texts)
        return [list(p) for p in self.token_ids]


def arrival_schedule(n: int, request_rate: float = math.inf, seed: int = 0) -> tuple[float, ...]:
    """When each of ``n`` requests arrives, in seconds from the start of its round: all at 0 when
    ``request_rate`` is infinite (everything at once); else a Poisson process of ``request_rate`` requests per
    second: the first at 0, then exponential gaps of mean 1 / ``request_rate`` drawn from
    ``random.Random(seed)`` (the same seed, the same schedule)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not request_rate > 0:  # NaN too
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if math.isinf(request_rate):
        return (0.0,) * n
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for k in range(n):
        if k:
            t += rng.expovariate(request_rate)
        arrivals.append(t)
    return tuple(arrivals)


def prompt_indices(workload_size: int, num_prompts: int | None = None) -> list[int]:
    """Which of the workload's prompts each request sends: request k sends prompt k mod ``workload_size``
    (``num_prompts`` None: each prompt once, in order)."""
    if workload_size < 1:
        raise ValueError(f"a workload needs at least one prompt, got {workload_size}")
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    return [k % workload_size for k in range(workload_size if num_prompts is None else num_prompts)]


def decode_prompt(loaded: LoadedModel, ids: Sequence[int]) -> str:
    """The text of a prompt, special tokens (chat markers) kept so the server tokenises the same prompt back."""
    return loaded.tokenizer.decode(ids, skip_special_tokens=False)


def serve_workload(loaded: LoadedModel, n: int) -> Workload:
    """W<n> of ``kvlab bench throughput``, the same prompts token for token."""
    from kvlab.bench.workloads import shared_prefix_prompts

    prompts = shared_prefix_prompts(loaded, n)
    return Workload(f"W{n}", tuple(tuple(p) for p in prompts), tuple(decode_prompt(loaded, p) for p in prompts))


def bench_workload(
    sender: RoundSender,
    workload: Workload,
    prompt_format: PromptFormat = "token-ids",
    repeats: int = 1,
    *,
    num_prompts: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
) -> ServeBenchResult:
    """``repeats`` rounds of ``num_prompts`` requests (default: each of the workload's prompts once) drawn from
    the workload's prompts in turn, arriving at ``request_rate`` per second (Poisson, seeded; inf: all at once);
    the round with the best wall time is reported."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    indices = prompt_indices(len(workload.token_ids), num_prompts)
    arrivals = arrival_schedule(len(indices), request_rate, seed)
    every = workload.prompts(prompt_format)
    prompts = [every[i] for i in indices]
    counts = [len(workload.token_ids[i]) for i in indices]
    rounds = [sender.run_round(prompts, counts, arrivals, indices) for _ in range(repeats)]
    walls = tuple(r.wall for r in rounds)
    best = min(range(len(rounds)), key=lambda i: walls[i])
    identical: bool | None = None
    if repeats > 1:
        texts = [tuple(r.text if r.ok else None for r in rnd.requests) for rnd in rounds]
        identical = all(t == texts[0] for t in texts) and None not in texts[0]
    return ServeBenchResult(
        workload=workload.name,
        url=sender.url,
        served_model=sender.model,
        prompt_format=prompt_format,
        max_tokens=sender.max_tokens,
        ignore_eos=sender.ignore_eos,
        repeats=repeats,
        round_walls=walls,
        best_round=best,
        requests=rounds[best].requests,
        outputs_identical_across_repeats=identical,
        workload_prompts=len(workload.token_ids),
        request_rate=request_rate,
        seed=seed,
        max_concurrency=sender.max_concurrency,
        arrivals=arrivals,
    )


def bench_serve(
    base_url: str,
    workloads: Sequence[Workload],
    max_tokens: int = 32,
    *,
    served_model: str | None = None,
    prompt_format: PromptFormat = "token-ids",
    ignore_eos: bool = True,
    timeout: float = 600.0,
    repeats: int = 1,
    warmup: bool = True,
    api_key: str | None = None,
    num_prompts: int | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
) -> ServeBench:
    """Every workload in turn against the server at ``base_url`` (with or without ``/v1``): ``num_prompts``
    requests each (default: each of its prompts once, the prompts cycled when there are more requests than
    prompts), arriving at ``request_rate`` per second (a Poisson process seeded with ``seed``; inf: all at once),
    at most ``max_concurrency`` in flight. The served model defaults to the first id of ``GET /v1/models``. The
    warm-up sends the first workload's first two prompts at once (within ``max_concurrency``), unmeasured; its
    failures are reported, not raised (the measured rounds show them again)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (None: no limit), got {max_concurrency}")
    arrival_schedule(0, request_rate)  # refuses a rate that is not > 0 before anything is sent
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    try:
        model = served_model or discover_model(base_url, api_key, timeout=min(timeout, 30.0), instead="--served-model")
    except ModelDiscoveryError as exc:
        raise ServeBenchError(str(exc)) from exc
    sender = RoundSender(
        base_url, model, max_tokens, ignore_eos, timeout, api_key=api_key, max_concurrency=max_concurrency
    )
    warm = None
    if warmup and workloads:
        first = workloads[0]
        warm = sender.run_round(first.prompts(prompt_format)[:2], [len(p) for p in first.token_ids[:2]])
    results = tuple(
        bench_workload(sender, w, prompt_format, repeats, num_prompts=num_prompts, request_rate=request_rate, seed=seed)
        for w in workloads
    )
    return ServeBench(server_root(base_url), model, warm, results)


def result_filename(served_model: str, request_rate: float, max_concurrency: int | None, date: str) -> str:
    """``--save-result``'s file name when none is given, vLLM's pattern with kvlab as its label:
    ``kvlab-{rate}qps[-concurrency{N}]-{model's last path part}-{date}.json`` (``date`` as vLLM writes it,
    ``%Y%m%d-%H%M%S``)."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"kvlab-{float(request_rate)}qps{concurrency}-{served_model.split('/')[-1]}-{date}.json"
