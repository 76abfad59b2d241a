"""``kvlab bench serve``'s helpers: its option checks, the table of one workload, and ``--save-result`` (vLLM's
flag: the result JSON under vLLM's file-name pattern, in ``--result-dir``). Heavy imports wait until called."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvlab.cli.common import int_list

if TYPE_CHECKING:
    from rich.console import Console

    from kvlab.bench.serve import LatencyStats, ServeBenchResult

DEFAULT_WORKLOADS = "16,64"


def check_requests(text: str | None) -> str | None:
    """An option callback: the workload sizes are checked when the command line is parsed."""
    if text is not None:
        int_list(text)
    return text


def check_request_rate(value: float) -> float:
    if not value > 0:  # NaN too
        raise typer.BadParameter(f"expected requests per second > 0 (inf: all at once), got {value}")
    return value


def workload_sizes(requests: str | None, num_prompts: int | None) -> list[int]:
    """The prompt sets W<N> to run: ``--requests``; without it W<num-prompts> (that many distinct prompts, each
    sent once, as vLLM draws ``--num-prompts`` samples of its dataset), else 16 and 64."""
    if requests is not None:
        return int_list(requests)
    return [num_prompts] if num_prompts is not None else int_list(DEFAULT_WORKLOADS)


def now() -> str:
    """The run's date as vLLM's result JSON writes it."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _stats(s: LatencyStats) -> str:
    return f"{_ms(s.mean)} / {_ms(s.median)} / {_ms(s.p99)}"


def traffic(r: ServeBenchResult) -> str:
    """How the requests were sent, in words."""
    arrivals = "all at once" if math.isinf(r.request_rate) else f"Poisson at {r.request_rate:g} req/s (seed {r.seed})"
    limit = f"at most {r.max_concurrency} in flight" if r.max_concurrency is not None else "no concurrency limit"
    n, k = r.workload_prompts, r.num_prompts
    if k > n:
        drawn = f"{k} requests cycling through {r.workload}'s {n} prompts"
    elif k < n:
        drawn = f"{k} requests: the first {k} of {r.workload}'s {n} prompts"
    else:
        drawn = f"{k} requests: {r.workload}'s prompts, each once"
    return f"{drawn}, {arrivals}, {limit}"


def print_result(out: Console, r: ServeBenchResult) -> None:
    """One workload's header line, table, notes and first error."""
    from rich.table import Table

    out.print(
        f"[bold]serve {r.workload}[/bold]: {traffic(r)}, streamed to {r.url} ({r.served_model}), {r.max_tokens} "
        f"greedy tokens/request{'' if r.ignore_eos else ' (EOS not ignored)'}, prompts as {r.prompt_format}, best "
        f"of {r.repeats}",
        highlight=False,
    )
    table = Table(title=f"serve: {r.workload}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("requests ok / failed", f"{r.completed} / {r.failed}"),
        ("duration s (first send to last end)", f"{r.wall_seconds:.3f}"),
        (f"output tokens (from {r.output_tokens_from})", str(r.output_tokens)),
        ("output tok/s", f"{r.output_tokens_per_second:.1f}"),
        ("requests/s", f"{r.requests_per_second:.2f}"),
        ("in flight: max / time-averaged", f"{r.max_concurrent_requests} / {r.mean_concurrent_requests:.2f}"),
        ("TTFT mean / median / p99 ms", _stats(r.ttft)),
        ("TPOT mean / median / p99 ms", _stats(r.tpot)),
        ("ITL mean / median / p99 ms", _stats(r.itl)),
        ("E2E mean / median / p99 ms", _stats(r.e2e)),
    ]
    if r.max_concurrency is not None:
        rows.append(("client queue mean / median / p99 ms", _stats(r.queue)))
    rows.append(("cached prompt tokens", "-" if r.cached_tokens is None else f"{r.cached_tokens}"))
    if r.repeats > 1:
        rows.append(("round walls s", ", ".join(f"{w:.3f}" for w in r.round_walls)))
        rows.append(("same texts every round", str(r.outputs_identical_across_repeats)))
    for name, value in rows:
        table.add_row(name, value)
    out.print(table)
    for note in r.notes:
        out.print(f"[yellow]note:[/yellow] {note}", highlight=False)
    if r.failed:
        out.print(f"[red]{r.failed} failed[/red]; first error:")
        out.print(r.first_error, markup=False, highlight=False)


METHOD_LINE = (
    "mean / median / p99 over the successful requests, by numpy as vllm bench serve computes them (p99 "
    "interpolated between the two nearest values); ITL pooled over every gap between text chunks"
)


def save_result(
    data: dict[str, Any],
    served_model: str,
    request_rate: float,
    max_concurrency: int | None,
    result_dir: Path | None,
    result_filename: str | None,
) -> Path:
    """``--save-result``: the JSON at ``--result-dir``/``--result-filename``, by default vLLM's name pattern
    (``kvlab-{rate}qps[-concurrency{N}]-{model}-{date}.json``) in the current directory."""
    from kvlab.bench.serve import result_filename as default_name

    name = result_filename or default_name(served_model, request_rate, max_concurrency, str(data["date"]))
    path = Path(name) if result_dir is None else Path(result_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    return path
