"""The engine loop and the vLLM-shaped ``LLM`` front end.

``Engine`` is the streaming interface (add_request / step / abort); ``LLM.generate`` drives it to
completion for a batch of prompts. One ``step``: schedule, apply copy-on-write copies, run the model
over the paged cache, sample, append tokens, finish requests and free their blocks.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvlab.config import CacheConfig, ConfigError, SchedulerConfig
from kvlab.engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from kvlab.engine.runner import ModelRunner
from kvlab.engine.sampling import InvalidRequestError, SamplingParams, sample
from kvlab.engine.scheduler import Scheduler
from kvlab.instrument.attention import AttentionCapture
from kvlab.instrument.sanitizer import KVSanitizer, Violation
from kvlab.instrument.trace import Trace
from kvlab.kv import KVCacheManager, KVStorage
from kvlab.model.loader import LoadedModel, load_model
from kvlab.model.packed import engine_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found in the cache
    kv_cache_usage_perc: float
    num_preemptions: int
    cow_copies: int
    num_requests_running: int
    num_requests_waiting: int
    num_free_blocks: int
    steps: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        trace: Trace | None = None,
        capture: AttentionCapture | None = None,
        packed_weights: bool | None = None,
    ) -> None:
        """``packed_weights``: run the linears on oneDNN-prepacked copies of the weights (see
        ``kvlab.model.packed.engine_model``). The loaded model itself is never changed: the dense reference
        keeps the plain kernels."""
        self.loaded = loaded
        self.capture = capture
        self.model = engine_model(loaded.model, packed_weights)
        self.tokenizer = loaded.tokenizer
        self.cache_config = cache or CacheConfig()
        self.scheduler_config = scheduler or SchedulerConfig(
            max_model_len=min(
                loaded.config.max_position_embeddings,
                self.cache_config.num_blocks * self.cache_config.block_size,
            )
        )
        mcfg = loaded.config
        if self.scheduler_config.max_model_len > mcfg.max_position_embeddings:
            raise ConfigError(
                f"SchedulerConfig.max_model_len must be <= the model's max_position_embeddings="
                f"{mcfg.max_position_embeddings}, got {self.scheduler_config.max_model_len}"
            )
        self.trace = trace
        self.kv = KVCacheManager(self.cache_config, trace=trace)
        self.storage = KVStorage(
            mcfg.num_layers,
            self.cache_config.num_blocks,
            self.cache_config.block_size,
            mcfg.num_kv_heads,
            mcfg.head_dim,
            layout=self.cache_config.layout,
            dtype=self.model.dtype,
        )
        self.sanitizer = (
            KVSanitizer(self.cache_config.num_blocks, self.cache_config.block_size)
            if self.cache_config.sanitize
            else None
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        self.runner = ModelRunner(
            self.model,
            self.kv,
            self.storage,
            self.sanitizer,
            filter_empty=self.scheduler_config.filter_empty,
            capture=capture,
        )
        self.groups: dict[str, list[Request]] = {}
        self.prompts: dict[str, str | None] = {}
        self.violations: list[Violation] = []
        self._ids = itertools.count()

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        salt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request. Raises ``InvalidRequestError`` before touching any shared state."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._validate(ids, params)
        req = Request(request_id, ids, params, salt=salt, arrival_time=arrival_time)
        self.groups[request_id] = [req]
        self.prompts[request_id] = text
        self.scheduler.add(req)
        return request_id

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        sc, cc = self.scheduler_config, self.cache_config
        vocab = self.loaded.config.vocab_size
        if not ids and sc.filter_empty:
            raise InvalidRequestError("the prompt is empty: at least one token is needed")
        bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad[1]} at prompt position {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        if len(ids) > sc.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens, more than max_model_len={sc.max_model_len}")
        if params.n > sc.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={sc.max_num_seqs}")
        longest = min(len(ids) + params.max_tokens, sc.max_model_len)
        # +1: a shared partial block is copied on the first write, which briefly needs a block more.
        needed = params.n * (-(-longest // cc.block_size) + 1)
        if needed > cc.num_blocks:
            raise InvalidRequestError(
                f"the request needs up to {needed} blocks of {cc.block_size} tokens (prompt {len(ids)} + "
                f"max_tokens {params.max_tokens}, n={params.n}) but the pool has only {cc.num_blocks}: "
                "it could never be scheduled"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its n sequences) at any moment and free every block it holds."""
        group = self.groups.get(request_id)
        if group is None or all(r.is_finished for r in group):
            return False
        for req in group:
            if not req.is_finished:
                self.scheduler.finish(req, "abort", RequestStatus.ABORTED)
                req.metrics.finished_time = time.monotonic()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request by one step; return the outputs of the groups that moved."""
        return [self.output(gid) for gid in self.advance()]

    def is_finished(self, request_id: str) -> bool:
        return all(r.is_finished for r in self.groups[request_id])

    def advance(self) -> list[str]:
        """One engine step without building outputs (detokenising every moving request each step is
        wasted work for batch callers); returns the ids of the groups that moved."""
        batch = self.scheduler.schedule()
        if self.trace is not None:
            self.trace.step = batch.step
        if self.capture is not None:
            self.capture.step = batch.step
        if not batch:
            if self.scheduler.waiting and not self.scheduler.running:
                head = self.scheduler.waiting[0]
                raise RuntimeError(f"{head} cannot be scheduled in an empty engine (pool too small?)")
            return []
        if batch.num_tokens == 0:
            # Only empty requests (unsafe path) are left: there is no row they could even misread.
            for s in batch.scheduled:
                self.scheduler.finish(s.request, "error")
            return [s.request.group_id for s in batch.scheduled]
        if batch.copies:
            self.storage.copy_blocks(batch.copies)
            if self.sanitizer is not None:
                self.sanitizer.copy_blocks(batch.copies)
        result = self.runner.execute(batch)
        # Only K/V that has really been written may be found by later prefix lookups.
        self.kv.commit_writes()
        self.violations.extend(result.violations)
        for s in batch.scheduled:
            s.request.num_computed_tokens += s.num_tokens

        now = time.monotonic()
        moved: dict[str, None] = {}
        sampled_reqs, row_logits = self._expand_forks(result.requests, result.logits)
        tokens = sample(row_logits, [r.params for r in sampled_reqs], [r.generator for r in sampled_reqs])
        for req, tok, logits in zip(sampled_reqs, tokens, row_logits, strict=True):
            req.output_token_ids.append(tok)
            if req.params.return_logits:
                req.logits.append(logits.clone())
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            reason = self._finish_reason(req, tok)
            if reason is not None:
                self.scheduler.finish(req, reason)
                req.metrics.finished_time = now
            moved[req.group_id] = None
        return list(moved)

    def _expand_forks(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[Request], torch.Tensor]:
        """n > 1: when the parent's prompt is done, fork n-1 children sharing all its blocks
        (refcount n, copy-on-write on their first divergent write); each samples from the same row."""
        if not any(r.params.n > 1 and len(self.groups[r.group_id]) == 1 for r in reqs):
            return reqs, logits
        out_reqs: list[Request] = []
        rows: list[int] = []
        for i, req in enumerate(reqs):
            out_reqs.append(req)
            rows.append(i)
            group = self.groups[req.group_id]
            if req.params.n > 1 and len(group) == 1:
                pos = self.scheduler.running.index(req)
                for k in range(1, req.params.n):
                    child = Request(
                        f"{req.group_id}#{k}",
                        req.prompt_token_ids,
                        req.params,
                        salt=req.salt,
                        group_id=req.group_id,
                        index=k,
                        arrival_time=req.metrics.arrival_time,
                    )
                    child.output_token_ids = list(req.output_token_ids)
                    child.num_computed_tokens = req.num_computed_tokens
                    child.num_cached_tokens = req.num_cached_tokens
                    child.status = RequestStatus.RUNNING
                    child.metrics.first_scheduled_time = req.metrics.first_scheduled_time
                    self.kv.fork(req.request_id, child.request_id)
                    self.scheduler.running.insert(pos + k, child)
                    group.append(child)
                    out_reqs.append(child)
                    rows.append(i)
        return out_reqs, logits[rows]

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and tok == self.tokenizer.eos_token_id:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.scheduler_config.max_model_len:
            return "length"
        return None

    # ------------------------------------------------------------------ outputs
    def output(self, request_id: str) -> RequestOutput:
        group = self.groups[request_id]
        head = group[0]
        completions = [
            CompletionOutput(
                r.index,
                self.tokenizer.decode(r.output_token_ids),
                list(r.output_token_ids),
                r.finish_reason,
                torch.stack(r.logits) if r.logits else None,
            )
            for r in group
        ]
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompts.get(request_id),
            prompt_token_ids=list(head.prompt_token_ids),
            outputs=completions,
            num_cached_tokens=head.num_cached_tokens or 0,
            finished=self.is_finished(request_id),
            metrics=head.metrics,
        )

    def stats(self) -> EngineStats:
        s = self.kv.stats
        return EngineStats(
            prefix_cache_queries=s.prefix_queries_tokens,
            prefix_cache_hits=s.prefix_hits_tokens,
            kv_cache_usage_perc=100.0 * self.kv.usage(),
            num_preemptions=self.scheduler.num_preemptions,
            cow_copies=s.cow_copies,
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.kv.num_free_blocks(),
            steps=self.scheduler.step,
        )


_CACHE_KNOBS = {f.name for f in fields(CacheConfig)}
_SCHED_KNOBS = {f.name for f in fields(SchedulerConfig)}


def split_knobs(knobs: dict[str, Any]) -> tuple[CacheConfig, dict[str, Any]]:
    unknown = set(knobs) - _CACHE_KNOBS - _SCHED_KNOBS
    if unknown:
        raise TypeError(
            f"unknown engine knob(s) {sorted(unknown)}; cache knobs: {sorted(_CACHE_KNOBS)}, "
            f"scheduler knobs: {sorted(_SCHED_KNOBS)}"
        )
    cache = CacheConfig(**{k: v for k, v in knobs.items() if k in _CACHE_KNOBS})
    sched = {k: v for k, v in knobs.items() if k in _SCHED_KNOBS}
    return cache, sched


class LLM:
    """Offline batch generation, shaped like vLLM's ``LLM``.

    >>> llm = LLM(model="mini", block_size=16, num_blocks=256, share_prefix=True)
    >>> outs = llm.generate(["今天天气很好"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(
        self,
        model: str | LoadedModel = "mini",
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        trace: Trace | None = None,
        capture: AttentionCapture | None = None,
        packed_weights: bool | None = None,
        **knobs: Any,
    ) -> None:
        loaded = load_model(model, dtype=dtype, seed=seed) if isinstance(model, str) else model
        cache, sched = split_knobs(knobs)
        if "max_model_len" not in sched:
            sched["max_model_len"] = min(loaded.config.max_position_embeddings, cache.num_blocks * cache.block_size)
        if "unsafe" not in sched:
            sched["unsafe"] = cache.unsafe
        self.engine = Engine(
            loaded, cache, SchedulerConfig(**sched), trace=trace, capture=capture, packed_weights=packed_weights
        )
        self.tokenizer = loaded.tokenizer

    @property
    def model(self) -> LoadedModel:
        return self.engine.loaded

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        salts: Sequence[str | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion. A prompt that is invalid gets an output with ``error`` set and
        finish_reason "error"; the others run normally."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        salts = list(salts) if salts is not None else [None] * len(prompts)
        ids: list[str | RequestOutput] = []
        eng = self.engine
        for prompt, p, salt in zip(prompts, params, salts, strict=True):
            rid = f"gen-{next(eng._ids)}"
            try:
                ids.append(eng.add_request(prompt, p, request_id=rid, salt=salt))
            except InvalidRequestError as exc:
                log.warning("request %s rejected: %s", rid, exc)
                ids.append(_error_output(rid, prompt, str(exc)))
        pending = [i for i in ids if isinstance(i, str)]
        self._run(pending, use_tqdm and len(pending) > 8)
        return [i if isinstance(i, RequestOutput) else eng.output(i) for i in ids]

    def _run(self, pending: list[str], progress: bool) -> None:
        eng = self.engine
        if not progress:
            while eng.has_unfinished_requests():
                eng.advance()
            return
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("generating", total=len(pending))
            done = 0
            while eng.has_unfinished_requests():
                eng.advance()
                now_done = sum(eng.is_finished(r) for r in pending)
                bar.advance(task, now_done - done)
                done = now_done

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _error_output(rid: str, prompt: Any, message: str) -> RequestOutput:
    from kvlab.engine.request import RequestMetrics

    return RequestOutput(
        request_id=rid,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=[] if isinstance(prompt, str) else list(prompt),
        outputs=[CompletionOutput(0, "", [], "error")],
        num_cached_tokens=0,
        finished=True,
        metrics=RequestMetrics(time.monotonic()),
        error=message,
    )
