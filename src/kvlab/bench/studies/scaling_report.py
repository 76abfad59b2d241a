"""The tables and the figure of ``kvlab bench scaling`` (``scaling.ScalingResult``): decode steps against batch
and context, prefill against prompt length, the KV cache's memory, each beside its mode's roofline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvlab.bench.studies.scaling import (
    BLOCK_SIZE,
    DECODE_WARMUP,
    PREFILL_ROOFLINE_NOTE,
    QUIET_NOTE,
    ROOFLINE_NOTE,
    DecodePoint,
    ScalingResult,
)
from kvlab.bench.table import Column, ResultTable, result_table, right_columns
from kvlab.memory import human_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _machine(result: ScalingResult) -> str:
    limits = "" if result.machine is None else f"; {result.machine.summary()}"
    return f"{result.model}, {_threads(result.threads)}{limits}"


def _threads(n: int) -> str:
    return f"{n} thread{'' if n == 1 else 's'}"


def decode_table(result: ScalingResult, sweep: str) -> ResultTable:
    """The batch sweep's or the context sweep's points, each against its roofline."""
    points = result.batch_sweep if sweep == "batch" else result.context_sweep
    fixed = (
        f"prompts of {result.sizes.context} tokens" if sweep == "batch" else f"{result.sizes.context_batch} requests"
    )
    return result_table(
        f"decode step vs {sweep} ({fixed}): {_machine(result)}",
        (
            Column("mode", no_wrap=True),
            *right_columns("batch", "context", "step ms", "forward ms", "overhead", "roofline ms", "step / roofline"),
            "bound",
            *right_columns("weights MB", "KV read MB"),
        ),
        [
            (
                p.mode,
                str(p.batch),
                str(p.context),
                f"{p.step_ms:.2f}",
                f"{p.forward_ms:.2f}",
                f"{100 * p.overhead_share:.0f}%",
                f"{p.roofline_ms:.2f}",
                f"{p.step_over_roofline:.2f}x",
                p.bound,
                f"{p.weight_bytes / 1e6:.1f}",
                f"{p.kv_bytes / 1e6:.1f}",
            )
            for p in points
        ],
        notes=[
            QUIET_NOTE,
            ROOFLINE_NOTE,
            f"median of {result.sizes.steps} timed steps after {DECODE_WARMUP} untimed ones; context: each "
            "request's tokens at the middle timed step; overhead: 1 - forward / step (scheduling, block tables, "
            "sampling, Python)",
            "KV read MB: batch x context x the model's K+V bytes per token in the cache dtype, what attention reads "
            "per step; the roofline's bytes are the weights and this",
            *filter(None, [result.cuts.get("--context" if sweep == "batch" else "--contexts")]),
        ],
    )


def prefill_table(result: ScalingResult) -> ResultTable:
    """Cold and warm (half cached) prefill side by side, one row per (mode, prompt length)."""
    warm_of = {(p.mode, p.prompt_tokens): p for p in result.prefill if p.cached_prefix_tokens}
    rows = []
    for cold in (p for p in result.prefill if not p.cached_prefix_tokens):
        warm = warm_of.get((cold.mode, cold.prompt_tokens))
        warm_cells = (
            ("-",) * 5
            if warm is None
            else (
                str(warm.cached_tokens),
                str(warm.computed_tokens),
                f"{warm.ms:.1f}",
                f"{warm.tokens_per_s:.0f}",
                f"{warm.over_roofline:.2f}x",
            )
        )
        steps = f"{cold.engine_steps}, {'-' if warm is None else warm.engine_steps}"
        cold_cells = (f"{cold.ms:.1f}", f"{cold.tokens_per_s:.0f}", f"{cold.over_roofline:.2f}x")
        rows.append((cold.mode, str(cold.prompt_tokens), *cold_cells, *warm_cells, steps))
    chunk = result.sizes.chunk
    budget = (
        f"max_num_batched_tokens={chunk} (--chunk): chunked prefill, ceil(computed / {chunk}) steps"
        if chunk
        else "max_num_batched_tokens = the prompt's length: the whole prompt in one step"
    )
    return result_table(
        f"prefill vs prompt length: {_machine(result)}",
        (
            Column("mode", no_wrap=True),
            *right_columns("prompt", "cold ms", "cold tok/s", "cold / roofline", "cached", "computed", "warm ms"),
            *right_columns("warm tok/s", "warm / roofline", "steps (cold, warm)"),
        ),
        rows,
        notes=[
            QUIET_NOTE,
            PREFILL_ROOFLINE_NOTE,
            f"one request of random tokens, max_tokens=1, on a fresh engine, fastest of {result.sizes.repeats}; "
            f"{budget}",
            f"warm: an earlier request in the same engine computed the prompt's first half in whole blocks of "
            f"{BLOCK_SIZE} (none in a prompt under {2 * BLOCK_SIZE} tokens: no warm run, -); cached is the "
            "engine's own count (num_cached_tokens), tok/s counts the computed tokens",
            *filter(None, [result.cuts.get("--prompt-lengths")]),
        ],
    )


def memory_table(result: ScalingResult) -> ResultTable:
    """The calculator's KV bytes and the pool's blocks, requests down, contexts across."""
    contexts = list(dict.fromkeys(p.context for p in result.memory))
    cells: dict[tuple[str, int], list[str]] = {}
    for p in result.memory:
        cells.setdefault((p.cache_dtype, p.requests), []).append(f"{human_bytes(p.kv_bytes)} / {p.blocks}")
    per_token = {p.cache_dtype: p.bytes_per_token for p in result.memory}
    beyond = [c for c in contexts if c > result.max_positions]
    return result_table(
        f"KV memory vs requests x context: {result.model} (kvlab.memory, no timing)",
        ("KV dtype", *right_columns("requests", *(f"{c} tokens" for c in contexts))),
        [(dtype, str(n), *row) for (dtype, n), row in cells.items()],
        notes=[
            "cell: KV bytes (2 x layers x kv_heads x head_dim x element bytes x tokens x requests; per token "
            + ", ".join(f"{d} {human_bytes(b)}" for d, b in per_token.items())
            + f") / blocks of {BLOCK_SIZE} tokens the pool needs (requests x ceil(context / {BLOCK_SIZE}))",
            f"the model's weights for comparison: {human_bytes(result.model_weight_bytes)} (dense, "
            f"{result.modes[0].split(' + ')[0]})",
            *(
                [f"contexts {', '.join(map(str, beyond))} exceed {result.model}'s {result.max_positions} positions"]
                if beyond
                else []
            ),
        ],
    )


def scaling_tables(result: ScalingResult) -> list[ResultTable]:
    tables = []
    if result.batch_sweep:
        tables.append(decode_table(result, "batch"))
    if result.context_sweep:
        tables.append(decode_table(result, "context"))
    if result.prefill:
        tables.append(prefill_table(result))
    if result.memory:
        tables.append(memory_table(result))
    return tables


def _decode_panel(
    ax: Axes, points: Sequence[DecodePoint], modes: Sequence[str], axis: tuple[str, str], title: str
) -> None:
    """One sweep's step ms per mode against ``axis`` (the points' field, its label); hidden without points."""
    from kvlab.bench.studies.kv_figures import log2_x

    if not points:
        ax.set_visible(False)
        return
    x, xlabel = axis
    for mode in modes:
        pts = sorted((p for p in points if p.mode == mode), key=lambda p: getattr(p, x))
        xs = [getattr(p, x) for p in pts]
        (line,) = ax.plot(xs, [p.step_ms for p in pts], "o-", label=mode)
        ax.plot(xs, [p.roofline_ms for p in pts], "--", color=line.get_color(), label=f"{mode} roofline")
        # Where attention starts reading more than the weights: past it, the K/V are most of the roofline's bytes.
        over = next((p for p in pts if p.kv_bytes >= p.weight_bytes), None)
        if over is not None:
            ax.axvline(getattr(over, x), color=line.get_color(), linestyle=":", alpha=0.6)
    ax.set_yscale("log")
    log2_x(ax, sorted({getattr(p, x) for p in points}))
    ax.set(xlabel=xlabel, ylabel="ms per decode step")
    ax.set_title(f"{title}\ndashed: roofline; dotted: KV reads pass the weights")
    ax.legend(fontsize=7)


def scaling_figure(result: ScalingResult) -> Figure:
    """Step ms against batch and against context (dashed: each mode's roofline), prefill tokens/s against prompt
    length (solid: cold, dashed: half cached, dotted: the cold prompt's roofline rate), KV GiB against context per
    request count. matplotlib without pyplot, as ``kvlab.bench.studies.kv_figures`` draws."""
    from matplotlib.figure import Figure

    from kvlab.bench.studies.kv_figures import log2_x

    fig = Figure(figsize=(13, 9.5))
    (batch_ax, context_ax), (prefill_ax, memory_ax) = fig.subplots(2, 2, squeeze=False)
    modes = list(result.modes)
    title = f"decode step vs batch (prompts of {result.sizes.context} tokens)"
    _decode_panel(batch_ax, result.batch_sweep, modes, ("batch", "requests in the batch"), title)
    title = f"decode step vs context ({result.sizes.context_batch} requests)"
    _decode_panel(context_ax, result.context_sweep, modes, ("prompt_tokens", "prompt tokens per request"), title)
    if result.prefill:
        for mode in modes:
            cold = [p for p in result.prefill if p.mode == mode and not p.cached_prefix_tokens]
            warm = [p for p in result.prefill if p.mode == mode and p.cached_prefix_tokens]
            (line,) = prefill_ax.plot(
                [p.prompt_tokens for p in cold], [p.tokens_per_s for p in cold], "o-", label=f"{mode} cold"
            )
            # The floor as a rate: the cold prompt's tokens in its roofline's time (a ceiling on tokens/s).
            prefill_ax.plot(
                [p.prompt_tokens for p in cold],
                [p.computed_tokens / (p.roofline_ms / 1e3) for p in cold],
                ":",
                color=line.get_color(),
                label=f"{mode} roofline",
            )
            if warm:
                prefill_ax.plot(
                    [p.prompt_tokens for p in warm],
                    [p.tokens_per_s for p in warm],
                    "s--",
                    color=line.get_color(),
                    label=f"{mode} half cached",
                )
        log2_x(prefill_ax, sorted({p.prompt_tokens for p in result.prefill}))
        prefill_ax.set(
            xlabel="prompt tokens",
            ylabel="tokens computed / s",
            title="prefill (solid: cold, dashed: first half cached, dotted: cold roofline)",
        )
        prefill_ax.legend(fontsize=7)
    else:
        prefill_ax.set_visible(False)
    if result.memory:
        dtype = result.memory[0].cache_dtype
        pts = [p for p in result.memory if p.cache_dtype == dtype]
        for n in dict.fromkeys(p.requests for p in pts):
            row = sorted((p for p in pts if p.requests == n), key=lambda p: p.context)
            memory_ax.plot(
                [p.context for p in row],
                [p.kv_bytes / 2**30 for p in row],
                "o-",
                label=f"{n} request{'' if n == 1 else 's'}",
            )
        memory_ax.axhline(result.model_weight_bytes / 2**30, color="grey", linestyle="--", label="model weights")
        memory_ax.set_yscale("log")
        log2_x(memory_ax, sorted({p.context for p in pts}))
        memory_ax.set(xlabel="context tokens per request", ylabel="GiB", title=f"KV cache ({dtype}), calculator")
        memory_ax.legend(fontsize=6, ncol=2)
    else:
        memory_ax.set_visible(False)
    fig.suptitle(f"kvlab bench scaling: {result.model}, {_threads(result.threads)}")
    fig.tight_layout()
    return fig
