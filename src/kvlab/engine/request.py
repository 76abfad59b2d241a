"""A request's lifecycle and what the engine returns for it.

waiting -> running -> finished | aborted, and running -> waiting again when preempted (its blocks
are freed; it is recomputed later, and its prefix may still hit the cache).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.engine.sampling import Logprob, SamplingParams, make_generator
from kvlab.engine.speculative import NgramIndex
from kvlab.instrument.sanitizer import prefix_digests


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class RequestMetrics:
    """A request's timeline, every time on the engine's monotonic clock (vLLM's ``arrival_time`` is wall-clock).

    Under vLLM V1's names (``RequestStateStats``): ``num_generation_tokens``, ``num_preemptions``, ``queued_ts``,
    ``scheduled_ts``, ``first_token_ts``, ``last_token_ts``, ``first_token_latency``, ``is_corrupted`` (0.0 where
    not reached yet, as vLLM's). The V0 names (``first_scheduled_time``, ``first_token_time``, ``finished_time``:
    None where not reached) stay, for callers that read them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    is_corrupted: bool = False  # it failed on non-finite logits

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queued_ts(self) -> float:
        """When it entered the waiting queue: its arrival (kvlab queues a request as it arrives)."""
        return self.arrival_time

    @property
    def scheduled_ts(self) -> float:
        return self.first_scheduled_time or 0.0

    @property
    def first_token_ts(self) -> float:
        return self.first_token_time or 0.0

    @property
    def last_token_ts(self) -> float:
        return self.last_token_time or 0.0

    @property
    def first_token_latency(self) -> float:
        return self.time_to_first_token or 0.0


class Request:
    """One sequence being generated. With n > 1, the children are Requests of their own that share the
    parent's blocks through ``fork``; ``group_id`` ties them together for the output."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        group_id: str | None = None,
        index: int = 0,
        arrival_time: float | None = None,
        tenant: str | None = None,
        public_prefix_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant  # whose share of the engine it runs on (the scheduler's fairness); None: the default
        self.group_id = group_id or request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.cache_salt = cache_salt
        # Its first public_prefix_tokens // block_size prompt blocks are public: shared across salts (KVCacheManager).
        self.public_prefix_tokens = public_prefix_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.num_public_cached_tokens = 0  # of which in public blocks (declared, promoted, or no salt)
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it ended with finish_reason "error"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.text_end: int | None = None  # where a matched stop string cuts the output text
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.generator = make_generator(None if params.seed is None else params.seed + index)
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        self.logits: list[torch.Tensor] = []
        self.drafter: NgramIndex | None = None  # speculative decoding's lookup over its tokens, from its first draft
        self._digests: list[int] = []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def seats(self) -> int:
        """Running sequences this request stands for: n until it forks its siblings (at its first token),
        then 1 each."""
        return self.params.n if self.index == 0 and not self.output_token_ids else 1

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def fork(self, request_id: str, index: int) -> Request:
        """A sibling for parallel sampling (n > 1): same prompt, same tokens so far, its own generator."""
        child = Request(
            request_id,
            self.prompt_token_ids,
            self.params,
            cache_salt=self.cache_salt,
            group_id=self.group_id,
            index=index,
            arrival_time=self.metrics.arrival_time,
            tenant=self.tenant,
            public_prefix_tokens=self.public_prefix_tokens,
        )
        child.output_token_ids = list(self.output_token_ids)
        child.prompt_logprobs = self.prompt_logprobs
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.num_public_cached_tokens = self.num_public_cached_tokens
        child.status = self.status
        child.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        return child

    def context_digests(self, upto: int) -> list[int]:
        """Digest of the whole token prefix [0..p] for every p < upto: what the sanitizer compares,
        because K/V at position p depends on every earlier token, not only token p."""
        if upto > len(self._digests):
            start = self._digests[-1] if self._digests else 0
            self._digests += prefix_digests(self.all_token_ids[len(self._digests) : upto], start)
        return self._digests[:upto]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logits: torch.Tensor | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token, when asked for (vLLM's shape)
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS or length


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when a sequence failed (finish_reason "error") or the request was refused
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # first entry None, as in vLLM

    # The first completion's fields, so the common n == 1 case reads like the DESIGN's API.
    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else "error"


def error_output(request_id: str, prompt: str | Sequence[int], message: str) -> RequestOutput:
    """The output of a request refused before it reached the engine."""
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=[] if isinstance(prompt, str) else list(prompt),
        outputs=[CompletionOutput(0, "", [], "error")],
        num_cached_tokens=0,
        finished=True,
        metrics=RequestMetrics(time.monotonic()),
        error=message,
    )
