"""One decode step under the microscope: engine step vs bare model forward, and the machine's roofline.

``Engine.advance()`` = schedule + ``ModelRunner.prepare`` (flat tensors, block tables -> slots) +
``ModelRunner.forward`` (the model over the paged cache, logits of the sampled rows) + sampling and
bookkeeping. The forward is timed inside the same steps, so step / forward is the share of everything
that is not the model. The step's roofline is its floor (``bench.studies.floor``, the throughput floor's cost
model): the work the engine logged for it (rows, attention pairs, K/V positions read) at the machine's measured
matmul peaks (``matmul_roofline``, each part at its dtype's) or at its memory bandwidth, whichever takes longer.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from kvlab.bench.modes import Mode
from kvlab.bench.studies.floor import Machine, WorkCosts
from kvlab.bench.table import ResultTable, result_table
from kvlab.config import CacheConfig, ModeConfig, SchedulerConfig, admission_blocks
from kvlab.engine.engine import Engine
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.stats import StepWork
from kvlab.memory import DEFAULT_BLOCK_SIZE
from kvlab.model.codes import quantize_w8a8
from kvlab.model.loader import LoadedModel
from kvlab.model.packed import PackedLinear, packable
from kvlab.model.quant import W8A8Linear


@dataclass(frozen=True)
class StepTiming:
    batch: int
    step_ms: float  # median Engine.advance()
    prepare_ms: float  # median ModelRunner.prepare
    forward_ms: float  # median ModelRunner.forward
    work: StepWork  # the middle timed step's work, as the engine logged it
    costs: WorkCosts  # what a unit of that work costs in this mode (its engine's)
    mode: str = "float32"

    @property
    def context(self) -> int:
        """Tokens in each request's context at the middle timed step (prompt + outputs so far)."""
        return self.work.context_tokens // self.batch

    @property
    def flops(self) -> float:
        return self.costs.flops(self.work)

    @property
    def weight_bytes(self) -> int:
        """The linear weights the step streams, as the engine stores them."""
        return self.costs.weight_bytes

    @property
    def kv_bytes(self) -> int:
        """The K/V the step reads: every context position of every request, in the cache's dtype."""
        return self.costs.kv_bytes_per_position * self.work.context_tokens

    @property
    def step_over_forward(self) -> float:
        return self.step_ms / self.forward_ms

    @property
    def gflops(self) -> float:
        return self.flops / self.step_ms / 1e6

    def bounds_ms(self, machine: Machine) -> tuple[float, float]:
        """(arithmetic, memory) of the step on ``machine``, in ms (``WorkCosts.bounds_s``)."""
        arithmetic, memory = self.costs.bounds_s(self.work, machine)
        return 1e3 * arithmetic, 1e3 * memory

    def roofline_ms(self, machine: Machine) -> float:
        """The step's floor on ``machine``: the larger bound, as the throughput floor prices a step."""
        return max(self.bounds_ms(machine))

    def as_dict(self, machine: Machine | None = None) -> dict:
        """The timing and its work; with ``machine``, its roofline there and the step's ratio to it."""
        plain = {k: v for k, v in asdict(self).items() if k != "costs"}
        if machine is not None:
            floor = self.roofline_ms(machine)
            plain |= {"roofline_ms": floor, "step_over_roofline": self.step_ms / floor}
        return plain | {
            "context": self.context,
            "flops": self.flops,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "step_over_forward": self.step_over_forward,
            "gflops": self.gflops,
        }


def step_table(rows: Sequence[StepTiming], machine: Machine, model: str, threads: int) -> ResultTable:
    """The timings of ``decode_step_timings`` as a table, each against its roofline on ``machine``
    (``StepTiming.roofline_ms``)."""
    columns = ("mode", "batch", "step ms", "prepare ms", "forward ms", "step / forward", "GFLOP/s", "weights MB")
    return result_table(
        f"decode step: {model}, {threads} threads; {machine.summary()} (matmul: 2048^3, torch.matmul or oneDNN's, "
        "the faster)",
        (*columns, "K/V MB", "roofline ms", "step / roofline"),
        [
            (
                r.mode,
                str(r.batch),
                f"{r.step_ms:.2f}",
                f"{r.prepare_ms:.2f}",
                f"{r.forward_ms:.2f}",
                f"{r.step_over_forward:.2f}x",
                f"{r.gflops:.1f}",
                f"{r.weight_bytes / 1e6:.0f}",
                f"{r.kv_bytes / 1e6:.1f}",
                f"{floor:.1f}",
                f"{r.step_ms / floor:.2f}x",
            )
            for r, floor in ((r, r.roofline_ms(machine)) for r in rows)
        ],
        notes=[
            "roofline ms: the step's floor, as the throughput floor prices a step: max(its FLOPs at the measured "
            "peaks (linears at their dtype's, attention at the model's), its weights and the K/V it reads at the "
            "memory bandwidth); at small batches the step is bound by its bytes, at large ones by arithmetic"
        ],
    )


def random_tokens(loaded: LoadedModel, count: int, rng: random.Random) -> list[int]:
    """``count`` random token ids of ``loaded``'s vocabulary (byte ids for a byte-level model)."""
    vocab = 256 if loaded.config.vocab_size <= 512 else loaded.config.vocab_size
    return [rng.randrange(vocab) for _ in range(count)]


def decode_max_tokens(decode_steps: int) -> int:
    """The max_tokens of ``decoding_engine``'s requests: ``decode_steps`` decode steps and two to spare, so that
    none finishes while the steps are timed."""
    return decode_steps + 2


def matmul_peaks(dtypes: Iterable[str]) -> dict[str, float]:
    """``matmul_roofline`` once for each distinct dtype name ("float32", "bfloat16", "int8")."""
    return {d: matmul_roofline(dtype=getattr(torch, d)) for d in dict.fromkeys(dtypes)}


def mode_peaks(modes: Iterable[Mode]) -> dict[str, float]:
    """``matmul_peaks`` of every dtype the modes' work runs at (``Mode.peak_dtypes``)."""
    return matmul_peaks(d for m in modes for d in m.peak_dtypes)


def decoding_engine(
    loaded: LoadedModel,
    batch: int,
    context: int,
    decode_steps: int,
    quantization: str | None = None,
    attention_backend: str = "reference",
    **knobs,
) -> Engine:
    """An engine whose ``batch`` requests (random ``context``-token prompts) are all past prefill, with at
    least ``decode_steps`` pure decode steps still ahead of them. ``knobs`` go to the cache config. Every prompt
    is prefilled in the same step: over several, the requests admitted first would decode ahead of the others
    and finish while the steps are timed (the timed batch shrank: docs/performance.md, "Decode step vs the mode's
    roofline")."""
    rng = random.Random(batch * 7919 + context)
    max_tokens = decode_max_tokens(decode_steps)
    bs = DEFAULT_BLOCK_SIZE
    per_request = admission_blocks(context + max_tokens, bs)
    eng = Engine(
        loaded,
        CacheConfig(block_size=bs, num_blocks=batch * per_request + 8, **knobs),
        SchedulerConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=max(2048, batch * context),
            max_model_len=min(loaded.config.max_position_embeddings, per_request * bs),
        ),
        mode=ModeConfig(quantization=quantization, attention_backend=attention_backend),
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(random_tokens(loaded, context, rng), params) for _ in range(batch)]
    eng.advance()
    if not all(eng.sequences(i)[0].output_token_ids for i in ids):
        raise RuntimeError(f"{batch} prompts of {context} tokens were not all prefilled in one step")
    return eng


def decode_step_timings(
    model_in: Callable[[str], LoadedModel],
    modes: Sequence[Mode],
    batch: int,
    context: int = 128,
    steps: int = 8,
    warmup: int = 2,
    **knobs,
) -> list[StepTiming]:
    """Median times of ``steps`` decode steps of ``batch`` requests whose prompts are ``context`` tokens, one
    engine per mode (``model_in(dtype)`` gives the model in a mode's dtype). The modes take turns step by
    step, so a slow spell of a shared machine falls on all of them alike rather than on whichever ran then."""
    engines = [
        decoding_engine(model_in(m.dtype), batch, context, warmup + steps, **m.engine_knobs(), **knobs) for m in modes
    ]
    for _ in range(warmup):
        for eng in engines:
            eng.advance()
    logs: list[list[StepWork]] = [[] for _ in engines]
    for eng, log in zip(engines, logs, strict=True):
        eng.work_log = log  # the timed steps' work, as each engine counts it
    times: list[tuple[list[float], list[float], list[float]]] = [([], [], []) for _ in modes]
    for _ in range(steps):
        for eng, (step, prepare, forward) in zip(engines, times, strict=True):
            if len(eng.scheduler.running) != batch:
                raise RuntimeError(f"a timed decode step of {len(eng.scheduler.running)} rows, not {batch}")
            t0 = time.perf_counter()
            eng.advance()
            step.append(time.perf_counter() - t0)
            prepare.append(eng.last_phases.prepare_s)
            forward.append(eng.last_phases.forward_s)
    # The middle step's work stands for the steps' (each reads one position more than the one before).
    return [
        StepTiming(
            batch=batch,
            step_ms=1e3 * statistics.median(step),
            prepare_ms=1e3 * statistics.median(prepare),
            forward_ms=1e3 * statistics.median(forward),
            work=log[steps // 2],
            costs=WorkCosts.of(eng),
            mode=m.name,
        )
        for m, eng, log, (step, prepare, forward) in zip(modes, engines, logs, times, strict=True)
    ]


def decode_step_timing(
    loaded: LoadedModel, batch: int, context: int = 128, steps: int = 8, warmup: int = 2, **knobs
) -> StepTiming:
    """``decode_step_timings`` of one model in its own dtype, default mode."""
    mode = Mode(str(loaded.model.dtype).removeprefix("torch."))
    return decode_step_timings(lambda _: loaded, [mode], batch, context, steps, warmup, **knobs)[0]


def matmul_roofline(
    size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32, budget_s: float = 2.0
) -> float:
    """Best GFLOP/s of a ``size`` cubed product in ``dtype`` with the current torch threads. int8: int8-w8a8's own
    linear (``W8A8Linear``), in GOP/s. Else the better of ``torch.matmul`` and a oneDNN prepacked linear
    (``PackedLinear``, the engine's own linears) where this torch has it. In fp32 ``torch.matmul`` is MKL's sgemm,
    which on some CPUs reaches half of what oneDNN does (docs/performance.md, "Decode step vs the mode's
    roofline"), and a roofline below what the engine's linears reach reads steps as faster than the machine.

    The side is halved (not below 256) until a product's repeats fit about ``budget_s``: where the CPU has no
    instructions for the dtype (bf16 on an AVX2-only CPU) torch runs a generic loop at ~1 GFLOP/s, a 2048-cube
    product takes 10-20 s, and a slow loop's rate is the same at a smaller size."""
    n = size
    probe_n = min(size, 256)
    probe = _products(probe_n, dtype)
    with torch.inference_mode():
        for product in probe:
            product()  # oneDNN's first call builds its kernel
            t0 = time.perf_counter()
            product()
            seconds = (time.perf_counter() - t0) * (n / probe_n) ** 3
            while n > probe_n and seconds * (repeats + 1) > budget_s / len(probe):
                n //= 2
                seconds /= 8
    best = float("inf")
    with torch.inference_mode():
        for product in probe if n == probe_n else _products(n, dtype):
            product()
            for _ in range(repeats):
                t0 = time.perf_counter()
                product()
                best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def _products(size: int, dtype: torch.dtype) -> list[Callable[[], torch.Tensor]]:
    """The ways the engine multiplies in ``dtype``, each as a ``size`` cubed product ready to run."""
    if dtype == torch.int8:  # int8-w8a8's linear as the engine runs it: per-token codes, the int32 product, scales
        w8a8 = W8A8Linear(quantize_w8a8(torch.randn(size, size)))
        x = torch.randn(size, size)
        return [lambda: w8a8(x)]
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    products: list[Callable[[], torch.Tensor]] = [lambda: torch.matmul(a, b)]
    linear = nn.Linear(size, size, bias=False).to(dtype)
    if packable(linear):
        packed = PackedLinear(linear)
        products.append(lambda: packed(a))
    return products


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Best GB/s of reading a buffer far larger than the caches (a sum over it)."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def profile_decode(
    loaded: LoadedModel, batch: int, context: int = 128, steps: int = 4, top: int = 15, mode: Mode | None = None
) -> str:
    """torch.profiler table (self CPU time) of a few decode steps at ``batch``."""
    from torch.profiler import ProfilerActivity, profile

    eng = decoding_engine(loaded, batch, context, steps + 1, **(mode or Mode()).engine_knobs())
    eng.advance()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.advance()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
