"""``kvlab bench serve``'s results as ``vllm bench serve`` files: written flat, one file per workload, in vLLM's
layout (its keys, its units, its conventions), and read back from either tool for ``--compare``.

vLLM 0.32 writes one JSON object per run: the run's setup (``backend``, ``model_id``, ``num_prompts``,
``request_rate``, ``burstiness``, ``max_concurrency``, ...), its totals and throughputs, per-request lists
(``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``latencies``, ``generated_texts``, ``errors``; with
``--save-detailed``) and ``{mean,median,std,p99}_{metric}_ms`` for each latency. Its conventions kept here: a
failed request has ``ttft`` 0, no ITLs and output length 0; a statistic with no value is 0;
``max_output_tokens_per_s`` and ``max_concurrent_requests`` are peaks over one-second buckets from the first
send. What vLLM has no key for (the workload, the cached prompt tokens, how output tokens were counted, the
notes) is under ``"kvlab"``, which vLLM's readers ignore.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.bench.serve_results import LatencyStats, RequestResult, ServeBenchResult
from kvlab.bench.table import Column, ResultTable, result_table

# The keys every vLLM 0.32 result file has (the per-request lists only with --save-detailed); a file without
# them was not written by vllm bench serve nor in its layout.
REQUIRED = (
    "backend",
    "model_id",
    "num_prompts",
    "request_rate",
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
)
METRICS = ("ttft", "tpot", "itl", "e2el")


class ResultFileError(ValueError):
    """A --compare file that is not a vLLM-layout result."""


def per_second_peaks(requests: Sequence[RequestResult]) -> tuple[float, int]:
    """vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests``: over one-second buckets counted from
    the first send of a successful request, the most tokens (chunks carrying text) that arrived in one bucket
    and the most requests active in one bucket (a request counts in every bucket from its send to its end)."""
    ok = [r for r in requests if r.ok]
    if not ok:
        return 0.0, 0
    first = min(r.start for r in ok)
    buckets = math.ceil(max(r.end for r in ok) - first) + 1
    tokens = np.zeros(buckets)
    active = np.zeros(buckets)
    for r in ok:
        for t in r.token_times:
            tokens[int(t - first)] += 1
        active[int(r.start - first) : int(r.end - first) + 1] += 1
    return float(tokens.max()), int(active.max())


def _stats_ms(metric: str, stats: LatencyStats) -> dict[str, float]:
    """vLLM's names in milliseconds; 0 where nothing was measured, as vLLM writes it."""
    return {k: 0.0 if v is None else v for k, v in stats.as_vllm(metric).items()}


def vllm_result(r: ServeBenchResult, *, date: str, tokenizer_id: str) -> dict[str, Any]:
    """One workload as the flat dict vLLM's ``--save-result --save-detailed`` writes."""
    reqs = r.requests
    peak_tokens, peak_requests = per_second_peaks(reqs)
    data: dict[str, Any] = {
        "date": date,
        "endpoint_type": "openai",
        "backend": "openai",
        "label": "kvlab",
        "model_id": r.served_model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": r.num_prompts,
        "request_rate": r.request_rate if math.isfinite(r.request_rate) else "inf",
        "burstiness": 1.0,  # Poisson arrivals: vLLM's gamma schedule at burstiness 1
        "max_concurrency": r.max_concurrency,
        "duration": r.wall_seconds,
        "completed": r.completed,
        "failed": r.failed,
        "total_input_tokens": r.input_tokens,
        "total_output_tokens": r.output_tokens,
        "request_throughput": r.requests_per_second,
        "request_goodput": None,
        "output_throughput": r.output_tokens_per_second,
        "total_token_throughput": r.total_tokens_per_second,
        "input_lens": [q.prompt_tokens_sent for q in reqs],
        "output_lens": [q.output_tokens if q.ok else 0 for q in reqs],
        "ttfts": [q.ttft if q.ok and q.ttft is not None else 0.0 for q in reqs],
        "itls": [list(q.itl) if q.ok else [] for q in reqs],
        "latencies": [q.e2e if q.ok else 0.0 for q in reqs],
        "start_times": [q.start for q in reqs],
        "queue_times": [q.queue for q in reqs],
        "generated_texts": [q.text if q.ok else "" for q in reqs],
        "errors": [q.error or "" for q in reqs],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
        "rtfx": 0.0,
        **_stats_ms("ttft", r.ttft),
        **_stats_ms("tpot", r.tpot),
        **_stats_ms("itl", r.itl),
        **_stats_ms("e2el", r.e2e),
    }
    if r.max_concurrency is not None:
        data.update(_stats_ms("client_queue_time", r.queue))
    data["kvlab"] = {
        "workload": r.workload,
        "workload_prompts": r.workload_prompts,
        "url": r.url,
        "prompt_format": r.prompt_format,
        "max_tokens": r.max_tokens,
        "ignore_eos": r.ignore_eos,
        "seed": r.seed,
        "repeats": r.repeats,
        "round_wall_seconds": list(r.round_walls),
        "cached_tokens": r.cached_tokens,
        "output_tokens_from": r.output_tokens_from,
        "max_in_flight": r.max_concurrent_requests,
        "notes": list(r.notes),
    }
    return data


def result_path(name: str, result_dir: Path | None, workload: str, several: bool) -> Path:
    """Where a workload's file goes: ``name`` in ``result_dir`` (default: here); with several workloads in the
    run, the workload's name before the suffix (``...-W16.json``), one file each."""
    path = Path(name) if result_dir is None else Path(result_dir) / name
    return path.with_name(f"{path.stem}-{workload}{path.suffix}") if several else path


def write_result(data: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


@dataclass(frozen=True)
class ResultFile:
    """A result in vLLM's layout, from either tool: its path, its figures, who wrote it."""

    path: Path
    data: dict[str, Any]

    @classmethod
    def read(cls, path: Path) -> ResultFile:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ResultFileError(f"{path}: cannot be read ({exc.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ResultFileError(f"{path}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ResultFileError(f"{path}: a vllm bench serve result is one JSON object, got {type(data).__name__}")
        if "workloads" in data:
            raise ResultFileError(
                f"{path}: kvlab's --json output (workloads nested); --compare reads the flat files --save-result writes"
            )
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise ResultFileError(f"{path}: not a vllm bench serve result: no {', '.join(missing)}")
        return cls(path, data)

    @property
    def writer(self) -> str:
        return "kvlab" if "kvlab" in self.data else f"vllm bench serve ({self.data.get('backend')})"

    def figure(self, key: str) -> float | None:
        value = self.data.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def traffic(self) -> tuple[int, str, Any]:
        """What makes two runs comparable: requests sent, arrivals, the concurrency limit."""
        return int(self.data["num_prompts"]), str(self.data["request_rate"]), self.data.get("max_concurrency")


# Rows of the comparison: vLLM's key, the label, whether more is better.
COMPARED: tuple[tuple[str, str, bool], ...] = (
    ("duration", "duration s", False),
    ("request_throughput", "requests/s", True),
    ("output_throughput", "output tok/s", True),
    ("total_input_tokens", "input tokens", True),
    ("total_output_tokens", "output tokens", True),
    *((f"{s}_{m}_ms", f"{m.upper()} {s} ms", False) for m in METRICS for s in ("mean", "median", "p99")),
)


def compare_table(ours: ResultFile, theirs: ResultFile) -> ResultTable:
    """This run's workload beside a result file, key by key, and theirs / ours where both have the figure
    (above 1: the file's figure is the larger)."""
    rows = []
    for key, label, _ in COMPARED:
        a, b = ours.figure(key), theirs.figure(key)
        if a is None and b is None:
            continue
        ratio = "-" if a is None or b is None or a == 0 else f"{b / a:.2f}"
        rows.append((label, "-" if a is None else f"{a:.1f}", "-" if b is None else f"{b:.1f}", ratio))
    notes = []
    if ours.traffic() != theirs.traffic():
        notes.append(
            "[yellow]note:[/yellow] the two runs sent different traffic (requests, rate, concurrency): "
            f"{ours.traffic()} here, {theirs.traffic()} there"
        )
    if ours.figure("total_input_tokens") != theirs.figure("total_input_tokens"):
        notes.append(
            "[yellow]note:[/yellow] the two runs sent other prompts (input tokens "
            f"{ours.data['total_input_tokens']} here, {theirs.data['total_input_tokens']} there): their latencies "
            "are of different work"
        )
    return result_table(
        f"compare: {theirs.path.name}",
        (
            Column("metric"),
            Column("this run", "right"),
            Column(theirs.path.name, "right"),
            Column("file / run", "right"),
        ),
        rows,
        notes=notes,
        heading=f"[bold]compare[/bold] {ours.data.get('kvlab', {}).get('workload', '')} with {theirs.path} "
        f"(written by {theirs.writer})",
    )


def matching(results: Sequence[ResultFile], other: ResultFile) -> ResultFile:
    """This run's workload with as many requests as the file's run sent (the one workload when there is one)."""
    if len(results) == 1:
        return results[0]
    n = other.traffic()[0]
    found = [r for r in results if r.traffic()[0] == n]
    if not found:
        sent = ", ".join(str(r.traffic()[0]) for r in results)
        raise ResultFileError(f"{other.path}: its run sent {n} requests; this run's workloads sent {sent}")
    return found[0]


__all__ = [
    "COMPARED",
    "REQUIRED",
    "ResultFile",
    "ResultFileError",
    "compare_table",
    "matching",
    "per_second_peaks",
    "result_path",
    "vllm_result",
    "write_result",
]
