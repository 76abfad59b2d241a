"""``kvlab bench scaling`` on the mini model with tiny grids: the points it gives and how they hang together (one
per mode and size, bounds that follow from the floors, the cached prefill computing only what was not cached,
KV bytes as the calculator counts them), the figure and the JSON. Timings are printed, never checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn
from typer.testing import CliRunner

from cli_output import words
from kvlab.bench.modes import Mode, ModelsByDtype, parse_modes
from kvlab.bench.studies.floor import Machine, WorkCosts
from kvlab.bench.studies.scaling import (
    DECODE_WARMUP,
    DecodePoint,
    PrefillRun,
    ScalingResult,
    ScalingSizes,
    bench_scaling,
    cache_dtype,
    decode_points,
    kv_shape,
)
from kvlab.bench.studies.scaling_report import memory_table, prefill_table, scaling_figure
from kvlab.bench.studies.step import decode_step_timings, decoding_engine
from kvlab.cli import app
from kvlab.engine.stats import StepWork
from kvlab.memory import kv_cache_bytes
from kvlab.model import load_model

SIZES = ScalingSizes(
    batches=(1, 2), context=16, contexts=(16, 32), context_batch=2, prompt_lengths=(16, 32, 48), steps=2, repeats=1
)
MODES = parse_modes("fp32,bf16")
PEAKS = {"float32": 50.0, "bfloat16": 100.0}  # given, not measured: the tests check structure, not speed
CLI = ["bench", "scaling", "--batches", "1,2", "--context", "16", "--contexts", "16,32", "--context-batch", "2",
       "--prompt-lengths", "16,32", "--steps", "2", "--repeats", "1", "--threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def result() -> ScalingResult:
    return bench_scaling(ModelsByDtype("mini"), MODES, SIZES, threads=1, machine=Machine(PEAKS, 10.0))


def test_one_decode_point_per_mode_and_size(result: ScalingResult) -> None:
    names = [m.name for m in MODES]
    assert sorted((p.mode, p.batch) for p in result.batch_sweep) == sorted((m, b) for m in names for b in (1, 2))
    assert {p.prompt_tokens for p in result.batch_sweep} == {16}
    assert sorted((p.mode, p.prompt_tokens) for p in result.context_sweep) == sorted(
        (m, c) for m in names for c in (16, 32)
    )
    assert {p.batch for p in result.context_sweep} == {2}
    for p in (*result.batch_sweep, *result.context_sweep):
        assert p.context == p.prompt_tokens + DECODE_WARMUP + 1 + SIZES.steps // 2  # the middle timed step
        assert p.step_ms > 0 and 0 < p.forward_ms <= p.step_ms


def test_the_bound_is_the_larger_floor(result: ScalingResult) -> None:
    dtype_of = {m.name: m.dtype for m in MODES}
    cfg = load_model("mini").config
    linear = sum(m.weight.numel() for m in load_model("mini").model.modules() if isinstance(m, nn.Linear))
    for p in (*result.batch_sweep, *result.context_sweep):
        # A decode step's arithmetic, the textbook count: every weight twice per row (the LM head too: each row
        # is sampled), QK^T and PV over the context; the engine's logged work priced by the floor's cost model.
        attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * p.context
        assert p.flops == p.batch * (2 * linear + attention)
        assert p.compute_floor_ms == pytest.approx(p.flops / PEAKS[dtype_of[p.mode]] / 1e6)
        # The bytes: the weights once, and the K/V of every position each request reads.
        assert p.bandwidth_floor_ms == pytest.approx((p.weight_bytes + p.kv_bytes) / 10.0 / 1e6)
        compute, bandwidth = p.flops / PEAKS[dtype_of[p.mode]] / 1e6, (p.weight_bytes + p.kv_bytes) / 10.0 / 1e6
        assert p.roofline_ms == pytest.approx(max(compute, bandwidth))
        assert p.bound == ("bandwidth" if bandwidth >= compute else "compute")
    fp32, bf16 = (next(p for p in result.batch_sweep if p.mode == m.name and p.batch == 1) for m in MODES)
    assert bf16.weight_bytes * 2 == fp32.weight_bytes  # each mode's weights as it stores them
    # The mini model's steps are all bandwidth-bound at these sizes; a point with more arithmetic is compute-bound.
    busy = DecodePoint(**{**fp32.__dict__, "compute_floor_ms": 2 * fp32.bandwidth_floor_ms})
    assert busy.bound == "compute" and fp32.bound == "bandwidth"
    assert json.loads(json.dumps(result.as_dict()))["decode"]["batch"][0]["bound"] == "bandwidth"


def test_a_mode_with_its_own_kv_dtype_counts_its_cache_in_that_dtype() -> None:
    """``cache_dtype``'s override: an fp32 model over a bf16 cache reads half the KV bytes of plain fp32."""
    loaded = load_model("mini")
    modes = [Mode("float32"), Mode("float32", kv_cache_dtype="bfloat16")]
    plain, halved = decode_points(lambda _: loaded, modes, "batch", [(2, 16)], 2, Machine(PEAKS, 10.0))
    assert cache_dtype(modes[1]) == "bf16" and halved.weight_bytes == plain.weight_bytes
    assert halved.kv_bytes * 2 == plain.kv_bytes > 0
    assert plain.bandwidth_floor_ms - halved.bandwidth_floor_ms == pytest.approx(halved.kv_bytes / 10.0 / 1e6)


def test_kv_bytes_are_the_calculators(result: ScalingResult) -> None:
    """The K/V a timed step reads, as its engine's pool stores a position, is what the calculator counts."""
    cfg = load_model("mini").config
    element = {"float32": 4, "bfloat16": 2}  # each mode's cache in its model's dtype
    for p in (*result.batch_sweep, *result.context_sweep):
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element[p.mode]
        assert p.kv_bytes == p.batch * p.context * per_token
    for p in result.memory:
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * {"fp32": 4, "bf16": 2}[p.cache_dtype]
        assert p.kv_bytes == p.requests * p.context * per_token == p.bytes_per_token * p.requests * p.context
        assert p.blocks == p.requests * -(-p.context // 16) and p.pool_bytes >= p.kv_bytes
    grid = {(p.cache_dtype, p.requests, p.context) for p in result.memory}
    assert grid == {(d, n, c) for d in ("fp32", "bf16") for n in (1, 2) for c in (16, 32)} and len(result.memory) == 8
    first = result.memory[0]
    assert first.kv_bytes == kv_cache_bytes(kv_shape(load_model("mini")), first.context, first.requests, "fp32")
    assert len(memory_table(result).rows) == 4  # (dtype, requests) down, contexts across


def test_the_warm_prefill_computes_what_was_not_cached(result: ScalingResult) -> None:
    cfg = load_model("mini").config
    linear = sum(m.weight.numel() for m in load_model("mini").model.modules() if isinstance(m, nn.Linear))
    head = cfg.hidden_size * cfg.vocab_size
    for p in result.prefill:
        # The textbook count of the logged work: 2 per weight per computed token, the LM head once (one row is
        # sampled), causal QK^T and PV of each computed query over itself and every position before it.
        cached, n = p.cached_tokens, p.prompt_tokens
        keys_seen = (n * (n + 1) - cached * (cached + 1)) // 2
        attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys_seen
        assert p.flops == 2 * (linear - head) * p.computed_tokens + 2 * head + attention
        assert p.roofline_ms == pytest.approx(max(p.compute_floor_ms, p.bandwidth_floor_ms))  # one step each
    for m in MODES:
        pts = [p for p in result.prefill if p.mode == m.name]
        cold = {p.prompt_tokens: p for p in pts if p.cached_prefix_tokens == 0}
        warm = {p.prompt_tokens: p for p in pts if p.cached_prefix_tokens}
        assert sorted(cold) == [16, 32, 48] and sorted(warm) == [32, 48]  # 16 tokens: no whole block in a half
        for p in cold.values():
            assert p.cached_tokens == 0 and p.computed_tokens == p.prompt_tokens and p.engine_steps == 1
        for length, p in warm.items():
            whole_blocks = length // 2 // 16 * 16  # 32 -> 16, 48 -> 16 (24 tokens: one whole block)
            assert p.cached_prefix_tokens == p.cached_tokens == whole_blocks  # the engine's own count
            assert p.computed_tokens == length - whole_blocks and p.engine_steps == 1
            assert p.flops < cold[length].flops and p.max_num_batched_tokens == length
    table = prefill_table(result)
    assert len(table.rows) == 2 * 3 and table.rows[0][5:10] == ("-",) * 5  # mode x length; 16 has no warm run


def test_chunked_prefill_takes_a_step_per_chunk() -> None:
    sizes = ScalingSizes(prompt_lengths=(64,), repeats=1, chunk=8)
    run = bench_scaling(
        ModelsByDtype("mini"), MODES[:1], sizes, decode=False, memory=False, machine=Machine(PEAKS, 10.0)
    )
    assert not run.batch_sweep and not run.memory
    assert [(p.computed_tokens, p.engine_steps, p.max_num_batched_tokens) for p in run.prefill] == [
        (64, 8, 8),
        (32, 4, 8),
    ]
    # A floor per step, summed, each the larger of its two bounds: the textbook count of every chunk of 8 tokens
    # (its weights read again, the K/V of its whole context read, the LM head on the last chunk's row only).
    cfg = load_model("mini").config
    linear = sum(m.weight.numel() for m in load_model("mini").model.modules() if isinstance(m, nn.Linear))
    head = cfg.hidden_size * cfg.vocab_size
    kv_per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    for p in run.prefill:
        compute = memory = floor = 0.0
        for start in range(p.cached_tokens, 64, 8):
            pairs = 8 * start + 8 * 9 // 2
            flops = (
                2 * (linear - head) * 8
                + 2 * head * (start + 8 == 64)
                + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
            )
            c, m = flops / PEAKS["float32"] / 1e6, (p.weight_bytes + kv_per_position * (start + 8)) / 10.0 / 1e6
            compute, memory, floor = compute + c, memory + m, floor + max(c, m)
        assert (p.compute_floor_ms, p.bandwidth_floor_ms, p.roofline_ms) == pytest.approx((compute, memory, floor))


def test_a_prefills_floor_is_the_sum_of_its_steps_larger_bounds() -> None:
    """Two steps, one bound by its arithmetic and one by its bytes: the floor sums each step's larger bound, as the
    throughput floor does (the larger of the two sums would be 3 ms here, not 4)."""
    costs = WorkCosts(
        dtype="float32",
        linear_dtype="float32",
        head_dtype="float32",
        linear_flops_per_row=1e6,
        head_flops_per_row=0.0,
        attention_flops_per_pair=0.0,
        weight_bytes=1_000_000,
        kv_bytes_per_position=0,
    )
    machine = Machine({"float32": 1.0}, bandwidth_gbps=1.0)  # 1 GFLOP/s: a row 1 ms; 1 GB/s: the weights 1 ms
    busy, light = StepWork(3, 0, 0, 0), StepWork(1, 0, 0, 0)  # 3 ms of arithmetic / 1 ms; 1 ms of bytes each
    p = PrefillRun(0.01, 0, (busy, light, light), costs).point("float32", 24, 0, 8, machine)
    assert p.engine_steps == 3
    assert (p.compute_floor_ms, p.bandwidth_floor_ms, p.roofline_ms) == pytest.approx((5.0, 3.0, 5.0))
    p = PrefillRun(0.01, 0, (busy, StepWork(0, 0, 0, 0)), costs).point("float32", 16, 0, 8, machine)
    assert (p.compute_floor_ms, p.bandwidth_floor_ms, p.roofline_ms) == pytest.approx((3.0, 2.0, 4.0))


def test_sizes_are_cut_to_the_models_positions_with_a_note() -> None:
    sizes, cuts = ScalingSizes(context=600, contexts=(128, 1024, 4096), prompt_lengths=(128, 512, 8192)).fitted(
        512, "mini"
    )
    limit = 512 - (DECODE_WARMUP + 6 + 2)
    assert (sizes.context, sizes.contexts, sizes.prompt_lengths) == (limit, (128, limit), (128, 511))
    assert (
        set(cuts) == {"--context", "--contexts", "--prompt-lengths"} and "1024, 4096 cut to 502" in cuts["--contexts"]
    )
    assert ScalingSizes().fitted(8192)[0].contexts[-1] == 8192 - 10  # SmolLM2's 8192 positions, 6 steps
    with pytest.raises(ValueError, match="too few"):
        ScalingSizes(steps=600).fitted(512)


@pytest.mark.parametrize(("batch", "longest"), [(8, True), (256, False)])
def test_every_timed_step_runs_the_whole_batch(batch: int, longest: bool) -> None:
    """Regression: decoding_engine prefilled a large batch over several steps and its first requests finished while
    the steps were timed (256 x 128: 162 rows down to 28). Now every prompt is prefilled in one step, and the pool
    holds 8 requests at the longest context the model allows as well as 256 at 128 tokens."""
    loaded = load_model("mini")
    context = ScalingSizes().fitted(loaded.config.max_position_embeddings)[0].contexts[-1] if longest else 128
    steps = DECODE_WARMUP + 6
    eng = decoding_engine(loaded, batch, context, steps)
    for _ in range(steps):
        assert len(eng.scheduler.running) == batch
        eng.advance()
    assert eng.scheduler.num_preemptions == 0


def test_a_timed_step_short_of_rows_is_an_error(monkeypatch) -> None:
    """The guard behind the regression above: a request that leaves before the timed steps end stops the timing
    instead of timing a smaller batch."""
    from kvlab.bench.studies import step

    loaded = load_model("mini")
    real = step.decoding_engine

    def one_aborted(*args, **kwargs):  # type: ignore[no-untyped-def]
        eng = real(*args, **kwargs)
        assert eng.abort(eng.scheduler.running[0].request_id)
        return eng

    monkeypatch.setattr(step, "decoding_engine", one_aborted)
    with pytest.raises(RuntimeError, match="a timed decode step of 1 rows, not 2"):
        decode_step_timings(lambda _: loaded, [MODES[0]], 2, 16, steps=2, warmup=0)


def test_the_command_writes_the_figure_and_the_json(tmp_path: Path) -> None:
    png = tmp_path / "scaling.png"
    res = CliRunner().invoke(app, [*CLI, "--plot", str(png), "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) >= {"decode", "prefill", "memory", "matmul_peak_gflops", "memory_gbps"}
    # Regression: the command measures the machine itself, and the result kept the peaks it was given (none):
    # the tables' titles read "matmul peak ; memory 0.0 GB/s" and the JSON {} and null.
    assert set(data["matmul_peak_gflops"]) == {"float32"} and data["matmul_peak_gflops"]["float32"] > 0
    assert data["memory_gbps"] > 0 and "memory 0.0 GB/s" not in res.stderr
    assert len(data["decode"]["batch"]) == 2 and len(data["decode"]["context"]) == 2 and len(data["prefill"]) == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "decode step vs batch" in res.stderr and "KV memory vs requests x context" in res.stderr


def test_the_figure_draws_each_modes_floor_beside_its_measurements(result: ScalingResult) -> None:
    fig = scaling_figure(result)
    batch_ax, _, prefill_ax, _ = fig.axes
    for mode in result.modes:
        lines = {line.get_label(): line for line in batch_ax.get_lines()}
        batch = sorted((p for p in result.batch_sweep if p.mode == mode), key=lambda p: p.batch)
        assert list(lines[f"{mode} roofline"].get_ydata()) == [p.roofline_ms for p in batch]
        lines = {line.get_label(): line for line in prefill_ax.get_lines()}
        cold = [p for p in result.prefill if p.mode == mode and not p.cached_prefix_tokens]
        rates = list(lines[f"{mode} roofline"].get_ydata())
        assert rates == pytest.approx([1e3 * p.prompt_tokens / p.roofline_ms for p in cold], rel=1e-12)
        # The floor is a ceiling on the rate: above every measured cold point's rate by its over_roofline factor.
        measured = list(lines[f"{mode} cold"].get_ydata())
        assert [r / m for r, m in zip(rates, measured, strict=True)] == pytest.approx(
            [p.over_roofline for p in cold], rel=1e-9
        )


def test_the_memory_part_alone_times_nothing() -> None:
    res = CliRunner().invoke(app, ["bench", "scaling", "--parts", "memory", "--batches", "1,4", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert "decode" not in data and "prefill" not in data and data["memory_gbps"] is None
    assert len(data["memory"]) == 2 * 7  # --batches x the default --contexts, uncut: the calculator's own


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--parts", "decode,speed"], "expected comma-separated parts from decode, prefill, memory"),
        (["--modes", "fp16"], "unknown or repeated word 'fp16'"),
        (["--batches", "0,2"], "expected comma-separated integers >= 1"),
    ],
)
def test_bad_options_are_refused_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, args: list[str], error: str
) -> None:
    import kvlab.model
    import kvlab.model.loader

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(kvlab.model, "load_model", refuse)
    monkeypatch.setattr(kvlab.model.loader, "load_model", refuse)
    res = CliRunner().invoke(app, ["bench", "scaling", *args])
    assert res.exit_code == 2 and error in words(res.output), res.output


def test_an_int8_w8a8_point_is_held_to_the_int8_peak() -> None:
    """The roofline's arithmetic runs at the peak of the mode's linears' dtype: int8 for int8-w8a8, the model's
    otherwise (``Mode.linear_dtype``)."""
    loaded = load_model("mini")
    modes = [Mode("float32"), Mode("float32", quantization="int8-w8a8")]
    assert [m.linear_dtype for m in modes] == ["float32", "int8"]
    assert Mode("bfloat16", quantization="int4").linear_dtype == "bfloat16"
    peaks = {"float32": 50.0, "int8": 5.0}
    plain, w8a8 = decode_points(lambda _: loaded, modes, "batch", [(2, 16)], 2, Machine(peaks, 10.0))
    assert plain.compute_floor_ms == pytest.approx(plain.flops / 50.0 / 1e6, rel=1e-9)
    # The layers' linears at the int8 peak; the LM head (kept in the model's dtype) and attention at fp32's.
    cfg = loaded.config
    head = 2 * cfg.hidden_size * cfg.vocab_size * w8a8.batch
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * w8a8.context * w8a8.batch
    layers = w8a8.flops - head - attention
    assert w8a8.compute_floor_ms == pytest.approx((layers / 5.0 + (head + attention) / 50.0) / 1e6, rel=1e-9)
