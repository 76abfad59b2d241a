"""``kvlab bench serve``'s helpers: its option checks, printing one workload (``kvlab.bench.serve.serve_table``
and its first error), and ``--save-result`` (vLLM's flag: the result JSON under vLLM's file-name pattern, in
``--result-dir``). Heavy imports wait until called."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvlab.cli.common import int_list, list_callback, render

if TYPE_CHECKING:
    from rich.console import Console

    from kvlab.bench.serve_results import ServeBenchResult

DEFAULT_WORKLOADS = "16,64"


check_requests = list_callback(int_list)  # the workload sizes, checked when the command line is parsed


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


def print_result(out: Console, r: ServeBenchResult) -> None:
    """One workload's header line, table, notes and first error."""
    from kvlab.bench.serve_results import serve_table

    render(out, serve_table(r))
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
