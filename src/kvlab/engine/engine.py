"""The engine: the streaming interface (add_request / step / abort) over scheduler, KV manager and runner.

One ``step``: schedule, apply copy-on-write copies, run the model over the paged cache, sample, append
tokens, finish requests and free their blocks.

Fault isolation: whatever goes wrong with one request inside a step (non-finite logits, a sampling
error, a failing detokenisation) fails that request alone, with ``finish_reason="error"`` and the reason
in ``RequestOutput.error``; the others go on. A failure of the forward pass itself cannot be pinned on
one request, so it fails the requests of that batch and the engine goes on with the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import Sequence

import torch

from kvlab.attention.flash import flash_prefill_kernel
from kvlab.attention.kernels import paged_attention_kernel
from kvlab.attention.paged import cascade_kernels
from kvlab.config import CacheConfig, ConfigError, ModeConfig, SchedulerConfig, admission_blocks
from kvlab.engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from kvlab.engine.runner import ModelRunner, StepResult
from kvlab.engine.sampling import (
    InvalidRequestError,
    Logprob,
    RowContext,
    SampledBatch,
    SamplingParams,
    bad_words_token_ids,
    make_generator,
    prompt_logprobs,
    sample,
)
from kvlab.engine.scheduler import ScheduledBatch, Scheduler
from kvlab.engine.sizing import default_max_model_len, kv_cache_dtype
from kvlab.engine.speculative import SpecDecodeStats
from kvlab.engine.stats import EngineStats, StepPhases, StepWork
from kvlab.instrument.attention import AttentionCapture
from kvlab.instrument.sanitizer import KVSanitizer, Violation
from kvlab.instrument.trace import Trace
from kvlab.kv import KVCacheManager, KVStorage
from kvlab.model.fused import compiled_argmax, compiled_topk
from kvlab.model.loader import LoadedModel
from kvlab.model.modes import engine_model

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        trace: Trace | None = None,
        capture: AttentionCapture | None = None,
        mode: ModeConfig | None = None,
        *,
        packed_weights: bool | None = None,
        quantization: str | None = None,
        attention_backend: str | None = None,
        seed: int | None = None,
    ) -> None:
        """``seed``: vLLM's engine seed, one generator every request without a seed of its own draws from (None: each
        such request draws from a generator of its own, seeded from the OS). ``mode``: how the model runs
        (``ModeConfig``: weight-only quantisation, the compiled kernels, packed linears); the model is
        ``kvlab.model.modes.engine_model(loaded, mode)``, the loaded model itself is never changed (the dense reference
        keeps the plain kernels). With ``attention_backend="cpp"`` attention runs on the compiled kernel that reads K/V
        in place (``kvlab.attention.kernels``); the reference serves, after one log line, where it cannot be built.
        ``packed_weights``, ``quantization``, ``attention_backend``: the same mode as loose keywords (the front ends'
        older spelling), refused together with ``mode``."""
        self.mode = ModeConfig.resolve(
            mode, packed_weights=packed_weights, quantization=quantization, attention_backend=attention_backend
        )
        self.loaded = loaded
        self.capture = capture
        self.generator = make_generator(seed)
        self.model = engine_model(loaded, self.mode)
        self.tokenizer = loaded.tokenizer
        self.cache_config = cache or CacheConfig()
        self.scheduler_config = scheduler or SchedulerConfig(
            max_model_len=default_max_model_len(loaded, self.cache_config)
        )
        mcfg = loaded.config
        if self.scheduler_config.max_model_len > mcfg.max_position_embeddings:
            raise ConfigError(
                f"SchedulerConfig.max_model_len must be <= the model's max_position_embeddings="
                f"{mcfg.max_position_embeddings}, got {self.scheduler_config.max_model_len}"
            )
        self.trace = trace
        self.storage = KVStorage(
            mcfg.num_layers,
            self.cache_config.num_blocks,
            self.cache_config.block_size,
            mcfg.num_kv_heads,
            mcfg.head_dim,
            layout=self.cache_config.layout,
            dtype=kv_cache_dtype(self.cache_config, loaded.model.dtype),
        )
        # The manager counts the blocks it copies; the storage knows what a block weighs (stats.cow_bytes).
        self.kv = KVCacheManager(self.cache_config, trace=trace, block_nbytes=self.storage.block_nbytes)
        self.sanitizer = (
            KVSanitizer(self.cache_config.num_blocks, self.cache_config.block_size, self.cache_config.promote_after)
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
            attention_kernel=paged_attention_kernel() if self.mode.compiled_kernels else None,
            flash_kernel=flash_prefill_kernel(self.model.dtype) if self.mode.compiled_kernels else None,
            cascade=cascade_kernels(self.model.dtype) if self.mode.compiled_kernels else None,
        )
        # Greedy argmax and top_k shortlists: the compiled ops with the compiled kernels (same results), torch's else.
        self._row_ops = (compiled_argmax(), compiled_topk()) if self.mode.compiled_kernels else (None, None)
        # Foreign reads the sanitizer caught, in the order they happened (empty without the sanitizer).
        self.violations: list[Violation] = []
        self._groups: dict[str, list[Request]] = {}
        self._prompts: dict[str, str | None] = {}
        self._ids = itertools.count()
        self._num_failed = 0
        self.last_phases = StepPhases(0.0, 0.0)
        spec = self.scheduler_config.speculative  # speculative decoding's counters, one per draft position
        self.spec_stats = SpecDecodeStats.positions(spec.num_speculative_tokens if spec else 0)
        self.work_log: list[StepWork] | None = None  # a list: each step's work is appended (bench: the floor)

    @property
    def quantization(self) -> str | None:
        """The mode's weight quantisation (``mode.quantization``)."""
        return self.mode.quantization

    # ----------------------------------------------------------------- requests
    def new_request_id(self, prefix: str = "") -> str:
        """An id no request of this engine has used."""
        while True:
            rid = f"{prefix}{next(self._ids)}"
            if rid not in self._groups:
                return rid

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        tenant: str | None = None,
        public_prefix_tokens: int = 0,
    ) -> str:
        """Validate and queue a request. Raises ``InvalidRequestError`` before touching any shared state.
        ``tenant``: whose share of the engine it runs on; the scheduler shares seats and blocks fairly between
        tenants (see ``Scheduler``), and promotion (``CacheConfig.promote_after``) counts tenants, never salts.
        Requests without one are one tenant, served first come, first served.
        ``public_prefix_tokens`` (0 .. prompt length): the full blocks among the prompt's first this many tokens
        are public, keyed without ``cache_salt``, so requests of any salt share them (``KVCacheManager``); the
        rest stays the salt's. Without prefix sharing it changes nothing."""
        params = params or SamplingParams()
        request_id = self.new_request_id() if request_id is None else str(request_id)
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]  # vLLM's rule: the prompt's last k tokens
        if params.bad_words and not params.bad_words_token_ids:
            params = dataclasses.replace(
                params, bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words)
            )
        self._validate(ids, params)
        n = public_prefix_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(ids):
            raise InvalidRequestError(
                f"public_prefix_tokens={n!r} must be an int in [0, {len(ids)}] (the prompt's length)"
            )
        req = Request(
            request_id,
            ids,
            params,
            cache_salt=cache_salt,
            arrival_time=arrival_time,
            tenant=tenant,
            public_prefix_tokens=n,
        )
        self._groups[request_id] = [req]
        self._prompts[request_id] = text
        self.scheduler.add(req)
        return request_id

    def _text(self, req: Request, ids: Sequence[int]) -> str:
        """The text of ``ids`` as ``req`` asks for it: none without ``detokenize``, special tokens kept or not."""
        if not req.params.detokenize:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)

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
        named = sorted(t for t in params.token_ids_used() if not 0 <= t < vocab)
        if named:
            raise InvalidRequestError(f"token ids {named[:5]} in stop_token_ids/logit_bias are outside [0, {vocab})")
        # vLLM's rule: a completion that cannot fit the context is an error, not a silent cut.
        if params.max_tokens is not None and len(ids) + params.max_tokens > sc.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {sc.max_model_len} tokens, but {len(ids) + params.max_tokens} "
                f"were requested ({len(ids)} in the prompt, {params.max_tokens} in the completion)"
            )
        longest = min(len(ids) + (params.max_tokens or sc.max_model_len), sc.max_model_len)
        needed = admission_blocks(longest, cc.block_size, params.n)
        if needed > cc.num_blocks:
            raise InvalidRequestError(
                f"the request needs up to {needed} blocks of {cc.block_size} tokens (prompt {len(ids)} + "
                f"max_tokens {params.max_tokens}, n={params.n}) but the pool has only {cc.num_blocks}: "
                "it could never be scheduled"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its n sequences) at any moment and free every block it holds."""
        group = self._groups.get(request_id)
        if group is None or all(r.is_finished for r in group):
            return False
        for req in group:
            if not req.is_finished:
                self.scheduler.finish(req, "abort", RequestStatus.ABORTED)
                req.metrics.finished_time = time.monotonic()
        return True

    def release(self, request_id: str) -> None:
        """Forget a finished request's outputs: a long-running server must not keep every group forever."""
        group = self._groups.get(request_id)
        if group is not None and not all(r.is_finished for r in group):
            raise ValueError(f"request {request_id!r} is still running; abort it first")
        self._groups.pop(request_id, None)
        self._prompts.pop(request_id, None)

    def sequences(self, request_id: str) -> list[Request]:
        """The request's sequences (n of them once forked), read-only by contract."""
        return list(self._groups[request_id])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def is_finished(self, request_id: str) -> bool:
        return all(r.is_finished for r in self._groups[request_id])

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request by one step; return the outputs of the groups that moved."""
        return [self.output(gid) for gid in self.advance()]

    def advance(self) -> list[str]:
        """One engine step without building outputs (detokenising every moving request each step is
        wasted work for batch callers); returns the ids of the groups that moved."""
        # Slots written by this step's forward pass become findable as the block exits: before any request
        # finishes, so a finished request's last blocks are cached, not discarded as never written.
        with self.kv.step():
            batch = self.scheduler.schedule()
            if self.trace is not None:
                self.trace.step = batch.step
            if self.capture is not None:
                self.capture.step = batch.step
            if not batch:
                return self._nothing_scheduled()
            if batch.num_tokens == 0:
                # Only empty requests (unsafe path) are left: there is no row they could even misread.
                for s in batch.scheduled:
                    self.scheduler.finish(s.request, "error")
                return [s.request.group_id for s in batch.scheduled]
            result = self._execute(batch)
        if result is None:
            return list(dict.fromkeys(s.request.group_id for s in batch.scheduled))
        for s in batch.scheduled:
            s.request.num_computed_tokens += s.num_verified  # a draft's tokens count once verified
        moved = self._sample_and_append(result)
        if self.sanitizer is not None and any(result.drafts):
            # After verification: what the index offers must hold no draft left unverified.
            self.violations += self.sanitizer.check_findable(self.kv.findable(), batch.step)
        return moved

    def _nothing_scheduled(self) -> list[str]:
        if self.scheduler.waiting and not self.scheduler.running:
            # Validation makes this unreachable for a sane pool; if it happens, only the head is at fault.
            head = self.scheduler.waiting.oldest()
            self.fail(head, "the request cannot be scheduled in an empty engine (KV pool too small)")
            return [head.group_id]
        return []

    def _execute(self, batch: ScheduledBatch) -> StepResult | None:
        """Copy-on-write copies, then the forward pass. None when the forward pass failed: that cannot be
        pinned on one request, so every request of the batch fails (the engine itself goes on)."""
        try:
            self._copy_blocks(batch.copies)
            t0 = time.perf_counter()
            prep = self.runner.prepare(batch)
            t1 = time.perf_counter()
            logits = self.runner.forward(prep)
            self.last_phases = StepPhases(t1 - t0, time.perf_counter() - t1)
            if self.work_log is not None:
                self.work_log.append(StepWork.of(batch, len(prep.sample_rows)))
            result = StepResult(prep.requests, logits, prep.violations, prep.drafts, prep.draft_slots)
        except Exception as exc:
            log.exception("step %d: the forward pass failed; failing its %d requests", batch.step, len(batch.scheduled))
            for s in batch.scheduled:
                self.fail(s.request, f"the forward pass failed: {type(exc).__name__}: {exc}")
            return None
        self.violations.extend(result.violations)
        return result

    def _generator_of(self, req: Request) -> torch.Generator | None:
        """What a request draws from: its own seed's generator; else the engine's (``seed``); else one of its own
        seeded from the OS, so no other request's draws move it (torch's global generator would let one
        request's sampling be observed through another's). A greedy request draws nothing."""
        if req.generator is not None or req.params.greedy:
            return req.generator
        if self.generator is not None:
            return self.generator
        req.generator = torch.Generator().manual_seed(secrets.randbits(63))
        return req.generator

    def _sample_and_append(self, result: StepResult) -> list[str]:
        """Every row of the step in one sampling call: a plain request's (its forks' too), and a drafted one's
        next token and draft, each verified after (``_verify``)."""
        now = time.monotonic()
        moved: dict[str, None] = {}
        drafted = [i for i, d in enumerate(result.drafts) if d]
        plain, plain_logits = result.requests, result.logits
        draft_rows: list[tuple[Request, list[int]]] = []
        draft_logits: list[torch.Tensor] = []
        if drafted:  # each request's first row samples as usual; a draft's rows, after them all, are verified
            firsts = list(itertools.accumulate((1 + len(d) for d in result.drafts[:-1]), initial=0))
            keep = [i for i, d in enumerate(result.drafts) if not d]
            plain, plain_logits = [result.requests[i] for i in keep], result.logits[[firsts[i] for i in keep]]
            for i in drafted:  # row j of a draft follows the request's tokens and the draft's first j, if accepted
                req, draft = result.requests[i], result.drafts[i]
                draft_rows += [(req, [*req.output_token_ids, *draft[:j]]) for j in range(len(draft) + 1)]
                draft_logits.append(result.logits[firsts[i] : firsts[i] + 1 + len(draft)])
        sampled_reqs, row_logits = self._expand_forks(plain, plain_logits)
        rows = [(r, r.output_token_ids) for r in sampled_reqs] + draft_rows
        logits = torch.cat([row_logits, *draft_logits]) if drafted else row_logits
        contexts = [RowContext(r.prompt_token_ids, out, self._stop_ids(r)) for r, out in rows]
        drawn = sample(
            logits, [r.params for r, _ in rows], [self._generator_of(r) for r, _ in rows], contexts, *self._row_ops
        )
        end = len(sampled_reqs)
        for i in drafted:
            req, start, end = result.requests[i], end, end + 1 + len(result.drafts[i])
            moved[req.group_id] = None
            self._verify(req, result.drafts[i], result.draft_slots[i], drawn.part(start, end), logits[start:end], now)
        for i, req in enumerate(sampled_reqs):
            moved[req.group_id] = None
            tok = drawn.tokens[i]
            if tok is None:
                req.metrics.is_corrupted = i in drawn.corrupted
                self.fail(req, drawn.errors[i])
                continue
            if req.params.prompt_logprobs is not None and req.prompt_logprobs is None:
                lps = prompt_logprobs(self.loaded.model, req.prompt_token_ids, req.params.prompt_logprobs)
                req.prompt_logprobs = [None if lp is None else self._decoded(lp) for lp in lps]
            reason = self._append(req, tok, drawn.logprobs[i], row_logits[i], now)
            if reason is not None:
                self.scheduler.finish(req, reason)
                req.metrics.finished_time = now
        return list(moved)

    def _append(
        self, req: Request, tok: int, lp: dict[int, Logprob] | None, row: torch.Tensor, now: float
    ) -> str | None:
        """Append one sampled token to ``req``; the finish reason it brings, if any (the caller finishes)."""
        req.output_token_ids.append(tok)
        if lp is not None:
            # Decoded once, here: every later output shares the entry (re-decoding each step's outputs
            # made a request's logprobs quadratic in its length, on the thread every request waits on).
            req.logprobs.append(self._decoded(lp))
            req.cumulative_logprob += lp[tok].logprob
        if req.params.return_logits:
            req.logits.append(row.clone())
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        req.metrics.num_generation_tokens = len(req.output_token_ids)
        return self._finish_reason(req, tok)

    def _verify(
        self, req: Request, draft: list[int], slots: list[int], drawn: SampledBatch, rows: torch.Tensor, now: float
    ) -> None:
        """A greedy request's rows over its next token and its draft: each row picked a token (``drawn``, one
        sampling call for the step) exactly as a plain step would given the tokens before it; a draft token is kept
        while it is the token picked at its position. The picked tokens are appended (the last one's K/V is
        computed next step, as after any step); the kept draft tokens' K/V, written this step, becomes the
        request's own (``KVCacheManager.accept_drafts``); the rejected slots never do, and the next write
        overwrites them."""
        accepted = 0
        reason: str | None = None
        for j in range(len(draft) + 1):
            tok = drawn.tokens[j]
            if tok is None:
                req.metrics.is_corrupted = j in drawn.corrupted
                reason = "error"
                break
            reason = self._append(req, tok, drawn.logprobs[j], rows[j], now)
            if j == len(draft) or tok != draft[j]:
                break
            accepted += 1
            if reason is not None:
                break
        self.spec_stats.observe(len(draft), accepted)
        if self.trace is not None:
            self.trace.emit(  # the draft's first position: the request's computed tokens before this verification
                "draft",
                req.request_id,
                position=req.num_computed_tokens,
                draft=draft,
                accepted=accepted,
                rejected_slots=slots[accepted:],
            )
        spec = self.scheduler_config.speculative
        if spec is not None and spec.commit_rejected:
            self.kv.take_back(req.request_id, len(draft) - accepted)  # unsafe: the index keeps them
        else:
            self.kv.accept_drafts(req.request_id, draft[:accepted])
        req.num_computed_tokens += accepted
        if self.sanitizer is not None and accepted:
            self.sanitizer.accept_draft(slots[:accepted], self.runner.namespace(req))
        if reason == "error":
            self.fail(req, drawn.errors[accepted])
        elif reason is not None:
            self.scheduler.finish(req, reason)
            req.metrics.finished_time = now

    def fail(self, req: Request, message: str) -> None:
        """End one sequence with finish_reason "error": its blocks are freed, nothing else is touched."""
        log.warning("request %s failed: %s", req.request_id, message)
        req.error = message
        self.scheduler.finish(req, "error")
        req.metrics.finished_time = time.monotonic()
        self._num_failed += 1

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply copy-on-write copies to the storage (and to the sanitizer's shadow), in their order."""
        if copies:
            self.storage.copy_blocks(copies)
            if self.sanitizer is not None:
                self.sanitizer.copy_blocks(copies)

    def _expand_forks(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[Request], torch.Tensor]:
        """n > 1: when the parent's prompt is done, fork n-1 children sharing all its blocks (refcount n; the
        shared partial last block is copied on the first write into it, or at the fork itself under
        ``cow_check="allocate"``: those copies are applied at once, the parent's K/V being written); each
        samples from the same row."""
        if not any(r.params.n > 1 and len(self._groups[r.group_id]) == 1 for r in reqs):
            return reqs, logits
        out_reqs: list[Request] = []
        rows: list[int] = []
        copies: list[tuple[int, int]] = []
        for i, req in enumerate(reqs):
            out_reqs.append(req)
            rows.append(i)
            group = self._groups[req.group_id]
            if req.params.n > 1 and len(group) == 1:
                for k in range(1, req.params.n):
                    child = req.fork(f"{req.group_id}#{k}", k)
                    # An empty prompt (the unsafe filter_empty=False path) holds no blocks: nothing to share.
                    if self.kv.has_request(req.request_id):
                        copies += self.kv.fork(req.request_id, child.request_id)
                    self.scheduler.add_running(child, after=group[-1])
                    group.append(child)
                    out_reqs.append(child)
                    rows.append(i)
        self._copy_blocks(copies)  # in one call, like a step's copies
        return out_reqs, logits[rows]

    def _stop_ids(self, req: Request) -> frozenset[int]:
        """Ids that end generation: masked while the request is short of min_tokens."""
        if len(req.output_token_ids) >= req.params.min_tokens:
            return frozenset()
        model_stops = () if req.params.ignore_eos else self.tokenizer.stop_token_ids
        return frozenset((*req.params.stop_token_ids, *model_stops))

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if len(req.output_token_ids) >= p.min_tokens:
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                self._cut_stop_token(req)
                return "stop"
            # Every model-level stop id (Llama-3's <|eot_id|>, a generation config's extra EOS ids), not only EOS.
            if not p.ignore_eos and tok in self.tokenizer.stop_token_ids:
                self._cut_stop_token(req)
                return "stop"
            if p.stop and self._match_stop_string(req):
                return "stop"
        limit = self.scheduler_config.max_model_len
        if (p.max_tokens is not None and len(req.output_token_ids) >= p.max_tokens) or req.num_tokens >= limit:
            return "length"
        return None

    def _cut_stop_token(self, req: Request) -> None:
        """The stop token's text is left out of the output text, as vLLM's detokenizer does (kept with
        include_stop_str_in_output); it stays in token_ids."""
        if not req.params.include_stop_str_in_output:
            req.text_end = len(self._text(req, req.output_token_ids[:-1]))

    def _match_stop_string(self, req: Request) -> bool:
        """A stop string anywhere in the output text, across token boundaries; the text is cut before it
        (or after it, with include_stop_str_in_output). Only the tail the newest token can have completed
        is searched."""
        text = self._text(req, req.output_token_ids)
        longest = max(len(s) for s in req.params.stop)
        # The newest token adds at most its own characters; a stop string ending in them starts this far back.
        tail = len(self._text(req, req.output_token_ids[-1:])) + longest
        start = max(0, len(text) - tail)
        hits = [(i, s) for s in req.params.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        req.stop_reason = stop
        req.text_end = at + len(stop) if req.params.include_stop_str_in_output else at
        return True

    # ------------------------------------------------------------------ outputs
    def output(self, request_id: str) -> RequestOutput:
        group = self._groups[request_id]
        head = group[0]
        return RequestOutput(
            request_id=request_id,
            prompt=self._prompts.get(request_id),
            prompt_token_ids=list(head.prompt_token_ids),
            outputs=[self._completion(r) for r in group],
            num_cached_tokens=head.num_cached_tokens or 0,
            finished=self.is_finished(request_id),
            metrics=head.metrics,
            error=next((r.error for r in group if r.error), None),
            prompt_logprobs=None if head.prompt_logprobs is None else list(head.prompt_logprobs),
        )

    def _completion(self, req: Request) -> CompletionOutput:
        try:
            text = self._text(req, req.output_token_ids)[: req.text_end]
        except Exception as exc:  # a tokenizer bug on one request's tokens must not reach the others
            if not req.is_finished:
                self.fail(req, f"detokenisation failed: {type(exc).__name__}: {exc}")
            text = ""
        return CompletionOutput(
            req.index,
            text,
            list(req.output_token_ids),
            req.finish_reason,
            torch.stack(req.logits) if req.logits else None,
            list(req.logprobs) if req.params.logprobs is not None else None,
            req.cumulative_logprob if req.params.logprobs is not None else None,
            req.stop_reason,
        )

    def _decoded(self, step: dict[int, Logprob]) -> dict[int, Logprob]:
        """One step's entries with their token texts (vLLM's ``decoded_token``)."""
        decode = self.tokenizer.decode
        return {t: dataclasses.replace(lp, decoded_token=decode([t])) for t, lp in step.items()}

    def stats(self) -> EngineStats:
        s = self.kv.stats
        return EngineStats(
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            kv_cache_usage_perc=100.0 * self.kv.usage(),
            num_preemptions=self.scheduler.num_preemptions,
            cow_copies=s.cow_copies,
            evictions=s.evictions,
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.kv.num_free_blocks(),
            num_evictable_blocks=self.kv.num_evictable_blocks(),
            num_failed_requests=self._num_failed,
            steps=self.scheduler.step,
            prefix_cache_hits_public=s.prefix_cache_hits_public,
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self.spec_stats.num_accepted_tokens_per_pos),
        )
