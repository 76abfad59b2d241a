"""The vLLM-shaped ``LLM`` front end: offline batch generation over one ``Engine``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any, cast

import torch

from kvlab.config import CacheConfig, ModeConfig, SchedulerConfig
from kvlab.engine.engine import Engine
from kvlab.engine.engine_args import VLLM_ENGINE_ARGS, translate
from kvlab.engine.request import RequestOutput, error_output
from kvlab.engine.sampling import InvalidRequestError, SamplingParams
from kvlab.engine.sizing import default_max_model_len, kv_block_nbytes
from kvlab.engine.stats import EngineStats
from kvlab.instrument.attention import AttentionCapture
from kvlab.instrument.sanitizer import Violation
from kvlab.instrument.trace import Trace
from kvlab.model.hf_loader import load_tokenizer
from kvlab.model.loader import LoadedModel, load_model
from kvlab.tokenizer import Tokenizer

log = logging.getLogger(__name__)


_CACHE_KNOBS = {f.name for f in fields(CacheConfig)}
_SCHED_KNOBS = {f.name for f in fields(SchedulerConfig)}


def split_knobs(knobs: dict[str, Any]) -> tuple[CacheConfig, dict[str, Any]]:
    unknown = set(knobs) - _CACHE_KNOBS - _SCHED_KNOBS
    if unknown:
        raise TypeError(
            f"unknown engine knob(s) {sorted(unknown)}; cache knobs: {sorted(_CACHE_KNOBS)}, "
            f"scheduler knobs: {sorted(_SCHED_KNOBS)}, "
            f"vLLM engine arguments: {sorted(a.name for a in VLLM_ENGINE_ARGS)} (docs/vllm-users.md)"
        )
    cache = CacheConfig(**{k: v for k, v in knobs.items() if k in _CACHE_KNOBS})
    sched = {k: v for k, v in knobs.items() if k in _SCHED_KNOBS}
    return cache, sched


DTYPES = {"float32": torch.float32, "auto": torch.float32, "bfloat16": torch.bfloat16}
# vLLM's names for the dtypes this CPU build does not serve.
UNSERVED = {"half": "float16", "float16": "float16", "fp16": "float16", "float": "float32 ('float32')"}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """vLLM's strings; "auto" is float32 here, the reference mode every fast path is checked against."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in UNSERVED and UNSERVED[dtype] == "float16":
        raise ValueError(
            f"dtype={dtype!r}: this CPU build serves no float16; use 'auto' or 'float32' (the reference) "
            "or 'bfloat16' (the fast mode)"
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)} or a torch.dtype, got {dtype!r}")
    return DTYPES[dtype]


Prompt = str | Sequence[int] | Mapping[str, Any]  # text, token ids, {"prompt": ...} or {"prompt_token_ids": [...]}


def _prompt_of(prompt: Prompt) -> str | Sequence[int]:
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"])
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    return prompt


class LLM:
    """Offline batch generation, shaped like vLLM's ``LLM``.

    >>> llm = LLM(model="mini", block_size=16, num_blocks=256, share_prefix=True)
    >>> outs = llm.generate(["今天天气很好"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(
        self,
        model: str | LoadedModel = "mini",
        *,
        seed: int | None = 0,
        weights_seed: int = 0,
        dtype: str | torch.dtype = "float32",
        trace: Trace | None = None,
        capture: AttentionCapture | None = None,
        mode: ModeConfig | None = None,
        packed_weights: bool | None = None,
        quantization: str | None = None,
        attention_backend: str | None = None,
        **knobs: Any,
    ) -> None:
        """``seed``: vLLM's, the generator of every request without a seed of its own (None: each such request draws
        from a generator of its own, seeded from the OS); ``weights_seed``: the mini model's random weights. ``dtype``:
        the model's (a name given as ``model`` is loaded in it). ``mode``: how the engine runs it (``ModeConfig``), or
        the same as the loose keywords ``quantization=``, ``attention_backend=``, ``packed_weights=`` (vLLM's spelling);
        ``knobs``: ``CacheConfig`` fields (``kv_cache_dtype`` among them), ``SchedulerConfig`` fields, and vLLM's engine
        arguments as ``kvlab.engine.engine_args`` maps them (``gpu_memory_utilization``, ``tokenizer``,
        ``tensor_parallel_size=1``, ...)."""
        mode = ModeConfig.resolve(
            mode, packed_weights=packed_weights, quantization=quantization, attention_backend=attention_backend
        )
        vllm = translate(knobs, model=model if isinstance(model, str) else None)
        cache, sched = split_knobs(vllm.knobs)  # unknown names refused before the model loads
        loaded = load_model(model, dtype=resolve_dtype(dtype), seed=weights_seed) if isinstance(model, str) else model
        if vllm.tokenizer is not None:
            loaded = replace(loaded, tokenizer=load_tokenizer(vllm.tokenizer, loaded.config.vocab_size))
        blocks = vllm.budget.num_blocks(cache.num_blocks, kv_block_nbytes(loaded, cache))
        if blocks != cache.num_blocks:
            cache = replace(cache, num_blocks=blocks)
        if vllm.noop:
            log.info("vLLM engine arguments accepted with no effect here: %s", ", ".join(vllm.noop))
        sched.setdefault("max_model_len", default_max_model_len(loaded, cache))
        if "unsafe" not in sched:
            sched["unsafe"] = cache.unsafe
        self.engine = Engine(
            loaded,
            cache,
            SchedulerConfig(**sched),
            trace=trace,
            capture=capture,
            mode=mode,
            seed=seed,
        )
        self.tokenizer = loaded.tokenizer

    @property
    def model(self) -> LoadedModel:
        return self.engine.loaded

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def chat(
        self,
        messages: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or several, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [
            self.tokenizer.apply_chat_template([dict(m) for m in cast("Sequence[Mapping[str, str]]", conv)])
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salts: Sequence[str | None] | None = None,
        public_prefix_tokens: int | Sequence[int] = 0,
        tenants: Sequence[str | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion. A prompt that is invalid gets an output with ``error`` set and
        finish_reason "error"; the others run normally. ``cache_salts``: each prompt's namespace in the prefix
        cache (vLLM's ``cache_salt``); ``public_prefix_tokens`` (one for all, or one per prompt): the full blocks
        among each prompt's first this many tokens are public, shared across salts (``Engine.add_request``);
        ``tenants``: whose each prompt is (the scheduler's fair share, and the parties ``promote_after`` counts:
        salts never count; default: all one tenant)."""
        batch: list[str | Sequence[int]]
        if isinstance(prompts, (str, Mapping)) or (prompts and isinstance(prompts[0], int)):
            batch = [_prompt_of(cast(Prompt, prompts))]  # one prompt
        else:
            batch = [_prompt_of(p) for p in cast("Sequence[Prompt]", prompts)]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"{len(params)} SamplingParams for {len(batch)} prompts")
        salts = list(cache_salts) if cache_salts is not None else [None] * len(batch)
        if len(salts) != len(batch):
            raise ValueError(f"{len(salts)} cache salts for {len(batch)} prompts")
        public = [public_prefix_tokens] * len(batch) if isinstance(public_prefix_tokens, int) else public_prefix_tokens
        if len(public) != len(batch):
            raise ValueError(f"{len(public)} public_prefix_tokens for {len(batch)} prompts")
        owners = list(tenants) if tenants is not None else [None] * len(batch)
        if len(owners) != len(batch):
            raise ValueError(f"{len(owners)} tenants for {len(batch)} prompts")
        ids: list[str | RequestOutput] = []
        eng = self.engine
        for prompt, p, salt, pub, tenant in zip(batch, params, salts, public, owners, strict=True):
            rid = eng.new_request_id("gen-")
            try:
                ids.append(
                    eng.add_request(prompt, p, request_id=rid, cache_salt=salt, public_prefix_tokens=pub, tenant=tenant)
                )
            except InvalidRequestError as exc:
                log.warning("request %s rejected: %s", rid, exc)
                ids.append(error_output(rid, prompt, str(exc)))
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

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix, as vLLM's ``LLM.reset_prefix_cache`` does: True when the cache was
        reset; False, and nothing changed, while any block is held by a request (``generate`` and ``chat``
        return with none in flight, so between two calls it always succeeds). With
        ``reset_running_requests`` the running requests are preempted first (their blocks freed; they are
        recomputed when the engine next runs), as vLLM does."""
        if reset_running_requests:
            sched = self.engine.scheduler
            for req in reversed(list(sched.running)):  # newest first, so the waiting queue keeps their order
                sched.preempt(req)
            if not self.engine.kv.reset_prefix_cache():
                raise RuntimeError("the prefix cache could not be reset with every running request preempted")
            return True
        return self.engine.kv.reset_prefix_cache()

    def violations(self) -> list[Violation]:
        """Foreign reads the KV sanitizer caught so far (needs ``sanitize=True``; empty otherwise)."""
        return list(self.engine.violations)
