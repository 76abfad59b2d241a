"""How cost grows with the work (``kvlab bench scaling``), each measurement against its mode's roofline.

* decode: one step's time against the batch (at a fixed context) and against the context (at a fixed batch),
  timed as ``decode_step_timings`` times it (the modes take turns step by step) on engines that prefill the
  whole batch in one step (``bench.step.decoding_engine``), with the step's roofline (``StepTiming.roofline_ms``:
  the step's floor as ``bench.studies.floor`` prices it, its FLOPs at the measured matmul peaks or its weights and
  the K/V it reads at the memory bandwidth, whichever takes longer), which of the two bounds it, the share of the
  step outside the model's forward, and the K/V bytes the step reads, so that a reader sees where attention's
  traffic overtakes the weights';
* prefill: one prompt on a fresh engine, cold and with its first half (whole blocks) already cached by an earlier
  request in the same engine, in tokens computed per second, against the floor of the steps it took;
* memory: the KV calculator's bytes (``kvlab.memory``) and the pool's blocks over requests x context, no timing.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from kvlab.bench.modes import Mode
from kvlab.bench.studies.floor import Machine, WorkCosts, weight_bytes
from kvlab.bench.studies.step import (
    StepTiming,
    decode_max_tokens,
    decode_step_timings,
    memory_bandwidth,
    mode_peaks,
    random_tokens,
)
from kvlab.config import admission_blocks, blocks_for
from kvlab.engine.engine import Engine
from kvlab.engine.llm import LLM
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.stats import StepWork
from kvlab.memory import DEFAULT_BLOCK_SIZE, KVShape, kv_bytes_per_token, kv_cache_bytes
from kvlab.model.loader import LoadedModel

BLOCK_SIZE = DEFAULT_BLOCK_SIZE  # what decoding_engine uses, and the default engine's
DECODE_WARMUP = 2  # untimed decode steps before the timed ones, as decode_step_timings takes
# The calculator's names (kvlab.memory.DTYPE_BYTES) of the dtypes a KV cache is stored in.
CALCULATOR_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}

QUIET_NOTE = (
    "[yellow]times hold only on a quiet machine:[/yellow] another process on these cores slows the steps, and "
    "their ratio to the roofline with them"
)
ROOFLINE_NOTE = (
    "roofline ms: the step's floor, as the throughput floor prices a step: max(its FLOPs at the measured matmul "
    "peaks (the linears at their dtype's, int8 for int8-w8a8; attention at the model's; a product of up to 2048^3: "
    "torch.matmul or oneDNN's, the faster), its weight bytes as the mode stores them and the K/V it reads / memory "
    "bandwidth (a sum over 512 MB)); bound: which of the two is larger"
)
PREFILL_ROOFLINE_NOTE = (
    "roofline: the floor of the prefill's steps (2 FLOPs per weight per computed token, the LM head once: one row "
    "is sampled; causal QK^T and PV; the weights once a step and the K/V read), priced as the decode steps are"
)


def cache_dtype(mode: Mode) -> str:
    """The calculator's name of the dtype ``mode`` stores K/V in (its model's unless it sets one)."""
    return CALCULATOR_DTYPES[mode.dtype if mode.kv_cache_dtype == "auto" else mode.kv_cache_dtype]


def kv_shape(loaded: LoadedModel) -> KVShape:
    """The part of the loaded model's shape that sizes its KV cache."""
    cfg = loaded.config
    return KVShape(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, name=loaded.name)


@dataclass(frozen=True)
class ScalingSizes:
    """The grids of the three parts; ``fitted`` cuts them to what a model's positions hold."""

    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    context: int = 128  # each request's prompt in the batch sweep
    contexts: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    context_batch: int = 8  # requests in the context sweep
    prompt_lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
    steps: int = 6  # timed decode steps per point (median)
    repeats: int = 2  # prefill runs per point; the fastest counts
    chunk: int | None = None  # prefill's max_num_batched_tokens; None: the whole prompt in one step

    @property
    def decoded_tokens(self) -> int:
        """Tokens a timed decode request generates past its prompt (``decoding_engine``'s max_tokens)."""
        return DECODE_WARMUP + decode_max_tokens(self.steps)

    def fitted(self, max_positions: int, model: str = "the model") -> tuple[ScalingSizes, dict[str, str]]:
        """These sizes with every decode context cut to ``max_positions`` minus the tokens the steps decode and
        every prompt to ``max_positions - 1`` (its one sampled token), repeats dropped; and a note per option cut,
        by its flag."""
        decode_limit = max_positions - self.decoded_tokens
        if decode_limit < 1:
            raise ValueError(f"{model} holds {max_positions} positions: too few for {self.steps} decode steps")
        notes: dict[str, str] = {}

        def cut(values: Sequence[int], limit: int, what: str, why: str) -> tuple[int, ...]:
            long = [v for v in values if v > limit]
            if long:
                notes[what] = f"{what} {', '.join(map(str, long))} cut to {limit}: {model} holds {max_positions} {why}"
            return tuple(dict.fromkeys(min(v, limit) for v in values))

        why = f"positions and each timed request decodes {self.decoded_tokens} tokens past its prompt"
        (context,) = cut([self.context], decode_limit, "--context", why)
        contexts = cut(self.contexts, decode_limit, "--contexts", why)
        prompts = cut(self.prompt_lengths, max_positions - 1, "--prompt-lengths", "positions, one for the output")
        return replace(self, context=context, contexts=contexts, prompt_lengths=prompts), notes


@dataclass(frozen=True)
class DecodePoint:
    """One mode's decode step at one (batch, prompt) point of a sweep, against its roofline."""

    sweep: str  # "batch": the batch varies at a fixed prompt; "context": the prompt varies at a fixed batch
    mode: str
    batch: int
    prompt_tokens: int  # each request's prompt
    context: int  # tokens in each request's context at the timed steps (StepTiming.context)
    step_ms: float  # median Engine.advance()
    prepare_ms: float
    forward_ms: float
    flops: float
    weight_bytes: int
    kv_bytes: int  # K and V the step reads: batch x context x the pool's bytes a position (the calculator's)
    compute_floor_ms: float  # its FLOPs at the measured peaks, each part at its dtype's (WorkCosts.bounds_s)
    bandwidth_floor_ms: float  # its weight and K/V bytes at the memory bandwidth

    @classmethod
    def of(cls, timing: StepTiming, sweep: str, prompt_tokens: int, machine: Machine) -> DecodePoint:
        compute, bandwidth = timing.bounds_ms(machine)
        return cls(
            sweep=sweep,
            mode=timing.mode,
            batch=timing.batch,
            prompt_tokens=prompt_tokens,
            context=timing.context,
            step_ms=timing.step_ms,
            prepare_ms=timing.prepare_ms,
            forward_ms=timing.forward_ms,
            flops=timing.flops,
            weight_bytes=timing.weight_bytes,
            kv_bytes=timing.kv_bytes,
            compute_floor_ms=compute,
            bandwidth_floor_ms=bandwidth,
        )

    @property
    def roofline_ms(self) -> float:
        """StepTiming.roofline_ms: the larger floor."""
        return max(self.compute_floor_ms, self.bandwidth_floor_ms)

    @property
    def bound(self) -> str:
        """What the roofline says limits the step: streaming the weights, or the arithmetic."""
        return "bandwidth" if self.bandwidth_floor_ms >= self.compute_floor_ms else "compute"

    @property
    def step_over_roofline(self) -> float:
        return self.step_ms / self.roofline_ms

    @property
    def overhead_share(self) -> float:
        """The share of the step outside the model's forward: scheduling, block tables, sampling, Python."""
        return 1 - self.forward_ms / self.step_ms

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "roofline_ms": self.roofline_ms,
            "bound": self.bound,
            "step_over_roofline": self.step_over_roofline,
            "overhead_share": self.overhead_share,
        }


def decode_points(
    model_in: Callable[[str], LoadedModel],
    modes: Sequence[Mode],
    sweep: str,
    cases: Sequence[tuple[int, int]],
    steps: int,
    machine: Machine,
) -> list[DecodePoint]:
    """A point per mode for each (batch, prompt tokens) of ``cases``, against its floor on ``machine``."""
    return [
        DecodePoint.of(t, sweep, prompt, machine)
        for batch, prompt in cases
        for t in decode_step_timings(model_in, modes, batch, prompt, steps, DECODE_WARMUP)
    ]


@dataclass(frozen=True)
class PrefillPoint:
    """One prompt's prefill (max_tokens=1) on a fresh engine, cold or after an earlier request cached its start."""

    mode: str
    prompt_tokens: int
    cached_prefix_tokens: int  # the prompt's first tokens an earlier request in the engine computed (0: cold)
    cached_tokens: int  # what the engine found cached (Request.num_cached_tokens)
    seconds: float  # fastest of the repeats, add_request to the first token
    engine_steps: int  # steps the prompt took: 1 unless max_num_batched_tokens chunks it
    max_num_batched_tokens: int
    flops: float  # of its steps, as the engine logged their work (WorkCosts.flops)
    weight_bytes: int  # the linears as the mode stores them, read once a step
    compute_floor_ms: float  # its steps' FLOPs at the measured peaks, each part at its dtype's
    bandwidth_floor_ms: float  # its steps' weight and K/V bytes at the memory bandwidth
    roofline_ms: float  # the floor of its steps: each step's larger bound, summed (WorkCosts.floor_s)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def tokens_per_s(self) -> float:
        """Tokens computed per second (the cached ones cost no arithmetic)."""
        return self.computed_tokens / self.seconds

    @property
    def ms(self) -> float:
        return 1e3 * self.seconds

    @property
    def over_roofline(self) -> float:
        return self.ms / self.roofline_ms

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "computed_tokens": self.computed_tokens,
            "tokens_per_s": self.tokens_per_s,
            "over_roofline": self.over_roofline,
        }


def cached_prefix(prompt_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """The warm run's cached prefix: the whole blocks of the prompt's first half (a block-granular cache, vLLM's,
    would find no more; token granularity would find the partial block too)."""
    return prompt_tokens // 2 // block_size * block_size


def _prefixes(prompt_tokens: int) -> tuple[int, ...]:
    """The cached prefixes a prompt is timed with: none, then its half's whole blocks if it has any."""
    return tuple(dict.fromkeys((0, cached_prefix(prompt_tokens))))


def random_prompt(loaded: LoadedModel, tokens: int) -> list[int]:
    return random_tokens(loaded, tokens, random.Random(tokens))


def _run_to_end(engine: Engine, request_id: str) -> None:
    while not engine.is_finished(request_id):
        engine.advance()
    if not engine.sequences(request_id)[0].output_token_ids:
        raise RuntimeError(f"request {request_id} ended without a token")


@dataclass(frozen=True)
class PrefillRun:
    """One timed prefill (``time_prefill``)."""

    seconds: float
    cached_tokens: int
    work: tuple[StepWork, ...]  # its steps' work, as the engine logged it: one entry a step
    costs: WorkCosts  # what a unit of that work costs in its engine's mode

    def point(self, mode: str, prompt_tokens: int, prefix_tokens: int, budget: int, machine: Machine) -> PrefillPoint:
        bounds = [self.costs.bounds_s(w, machine) for w in self.work]
        return PrefillPoint(
            mode,
            prompt_tokens,
            prefix_tokens,
            self.cached_tokens,
            self.seconds,
            len(self.work),
            budget,
            flops=sum(self.costs.flops(w) for w in self.work),
            weight_bytes=self.costs.weight_bytes,
            compute_floor_ms=1e3 * sum(c for c, _ in bounds),
            bandwidth_floor_ms=1e3 * sum(b for _, b in bounds),
            roofline_ms=1e3 * self.costs.floor_s(self.work, machine),
        )


def time_prefill(loaded: LoadedModel, mode: Mode, prompt: Sequence[int], prefix_tokens: int, budget: int) -> PrefillRun:
    """``prompt`` on a fresh engine in ``mode``, after an untimed request of its first ``prefix_tokens`` (0: none)
    in the same engine: its time, steps, cached tokens and logged work."""
    blocks = admission_blocks(len(prompt) + 1, BLOCK_SIZE)
    engine = LLM(
        loaded,
        **mode.engine_knobs(),
        block_size=BLOCK_SIZE,
        num_blocks=2 * blocks,  # the prefix's blocks stay cached beside the prompt's own
        max_num_seqs=1,
        max_num_batched_tokens=budget,
        max_model_len=len(prompt) + 1,
    ).engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    if prefix_tokens:
        _run_to_end(engine, engine.add_request(list(prompt[:prefix_tokens]), params))
    log: list[StepWork] = []
    engine.work_log = log
    t0 = time.perf_counter()
    request_id = engine.add_request(list(prompt), params)
    _run_to_end(engine, request_id)
    seconds = time.perf_counter() - t0
    cached = engine.sequences(request_id)[0].num_cached_tokens or 0
    return PrefillRun(seconds, cached, tuple(log), WorkCosts.of(engine))


def prefill_points(
    model_in: Callable[[str], LoadedModel],
    modes: Sequence[Mode],
    prompt_lengths: Sequence[int],
    repeats: int,
    machine: Machine,
    chunk: int | None = None,
) -> list[PrefillPoint]:
    """A cold point per (mode, prompt length), and a warm one where the prompt's half holds a whole block, each
    the fastest of ``repeats``; the modes and lengths take turns within each repeat, so a slow spell of a shared
    machine falls on all of them alike."""
    for m in modes:  # first calls (kernel builds, allocator growth) stay out of the timings
        loaded = model_in(m.dtype)
        time_prefill(loaded, m, random_prompt(loaded, min(prompt_lengths)), 0, chunk or min(prompt_lengths))
    best: dict[tuple[str, int, int], PrefillRun] = {}
    for _ in range(repeats):
        for length in prompt_lengths:
            for m in modes:
                loaded = model_in(m.dtype)
                prompt = random_prompt(loaded, length)
                for prefix in _prefixes(length):
                    run = time_prefill(loaded, m, prompt, prefix, chunk or length)
                    key = (m.name, length, prefix)
                    if key not in best or run.seconds < best[key].seconds:
                        best[key] = run
    return [
        best[(m.name, length, prefix)].point(m.name, length, prefix, chunk or length, machine)
        for length in prompt_lengths
        for m in modes
        for prefix in _prefixes(length)
    ]


@dataclass(frozen=True)
class KVMemoryPoint:
    """The calculator's KV bytes of ``requests`` requests of ``context`` tokens, and the pool blocks they take."""

    cache_dtype: str  # the calculator's name: fp32 | bf16
    requests: int
    context: int
    kv_bytes: int  # kvlab.memory.kv_cache_bytes
    bytes_per_token: int
    block_size: int
    blocks: int  # requests x ceil(context / block_size)

    @property
    def pool_bytes(self) -> int:
        """What the blocks hold, the partial last block of each request included."""
        return self.blocks * self.block_size * self.bytes_per_token

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"pool_bytes": self.pool_bytes}


def memory_points(
    shape: KVShape, cache_dtypes: Sequence[str], requests: Sequence[int], contexts: Sequence[int]
) -> list[KVMemoryPoint]:
    return [
        KVMemoryPoint(
            dtype,
            n,
            c,
            kv_cache_bytes(shape, c, n, dtype),
            kv_bytes_per_token(shape, dtype),
            BLOCK_SIZE,
            n * blocks_for(c, BLOCK_SIZE),
        )
        for dtype in dict.fromkeys(cache_dtypes)
        for n in requests
        for c in contexts
    ]


@dataclass(frozen=True)
class ScalingResult:
    model: str
    max_positions: int
    threads: int
    modes: tuple[str, ...]
    sizes: ScalingSizes  # as run: cut to the model's positions
    model_weight_bytes: int  # the first mode's dtype, dense: the memory part's yardstick
    machine: Machine | None = None  # the limits the timed parts were priced at (None: memory only)
    batch_sweep: tuple[DecodePoint, ...] = ()
    context_sweep: tuple[DecodePoint, ...] = ()
    prefill: tuple[PrefillPoint, ...] = ()
    memory: tuple[KVMemoryPoint, ...] = ()
    cuts: dict[str, str] = field(default_factory=dict)  # flag -> what ``ScalingSizes.fitted`` cut in it

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "max_position_embeddings": self.max_positions,
            "threads": self.threads,
            "modes": list(self.modes),
            "sizes": asdict(self.sizes),
            "model_weight_bytes": self.model_weight_bytes,
            **(self.machine.as_dict() if self.machine else {"matmul_peak_gflops": {}, "memory_gbps": None}),
            "cuts": self.cuts,
        }
        if self.batch_sweep or self.context_sweep:
            out["decode"] = {
                "batch": [p.as_dict() for p in self.batch_sweep],
                "context": [p.as_dict() for p in self.context_sweep],
            }
        if self.prefill:
            out["prefill"] = [p.as_dict() for p in self.prefill]
        if self.memory:
            out["memory"] = [p.as_dict() for p in self.memory]
        return out


def bench_scaling(
    model_in: Callable[[str], LoadedModel],
    modes: Sequence[Mode],
    sizes: ScalingSizes | None = None,
    decode: bool = True,
    prefill: bool = True,
    memory: bool = True,
    threads: int | None = None,
    machine: Machine | None = None,
) -> ScalingResult:
    """The parts asked for, ``sizes`` first cut to the model's positions. The matmul peaks of each mode's dtypes and
    the memory bandwidth are measured once, before any timing, unless given (``machine``)."""
    first = model_in(modes[0].dtype)
    max_positions = first.config.max_position_embeddings
    sizes = sizes or ScalingSizes()
    fitted, cuts = sizes.fitted(max_positions, first.name)
    batch_sweep: list[DecodePoint] = []
    context_sweep: list[DecodePoint] = []
    prefill_run: list[PrefillPoint] = []
    if not (decode or prefill):
        machine = None  # nothing timed, nothing priced
    elif machine is None:
        machine = Machine(mode_peaks(modes), memory_bandwidth())
    if machine is not None:
        if decode:
            cases = [(b, fitted.context) for b in fitted.batches]
            batch_sweep = decode_points(model_in, modes, "batch", cases, fitted.steps, machine)
            cases = [(fitted.context_batch, c) for c in fitted.contexts]
            context_sweep = decode_points(model_in, modes, "context", cases, fitted.steps, machine)
        if prefill:
            prefill_run = prefill_points(model_in, modes, fitted.prompt_lengths, fitted.repeats, machine, fitted.chunk)
    memory_run = (
        memory_points(kv_shape(first), [cache_dtype(m) for m in modes], fitted.batches, sizes.contexts)
        if memory
        else []
    )
    return ScalingResult(
        model=first.name,
        max_positions=max_positions,
        threads=torch.get_num_threads() if threads is None else threads,
        modes=tuple(m.name for m in modes),
        sizes=fitted,
        model_weight_bytes=weight_bytes(first.model),
        machine=machine,
        batch_sweep=tuple(batch_sweep),
        context_sweep=tuple(context_sweep),
        prefill=tuple(prefill_run),
        memory=tuple(memory_run),
        cuts=cuts,
    )
