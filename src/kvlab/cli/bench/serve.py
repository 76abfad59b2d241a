"""``kvlab bench serve``: the command, its option checks, printing one workload (``kvlab.bench.serve_results``'s
table and its first error), ``--save-result`` (vLLM's flag: each workload's result in vLLM's layout under vLLM's
file-name pattern, in ``--result-dir``) and ``--compare`` (a result file of either tool beside this run). Heavy
imports wait until called."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvlab.bench.serve_results import PromptFormat
from kvlab.cli.common import (
    JsonOption,
    ModelOption,
    dump_json,
    fail,
    int_list,
    list_callback,
    load_or_exit,
    out_console,
    render,
    writable_folder,
)

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


def save_result_files(
    results: dict[str, dict[str, Any]],
    name: str,
    result_dir: Path | None,
) -> list[Path]:
    """``--save-result``: each workload's flat result (``kvlab.bench.vllm_results``) as ``name`` in
    ``--result-dir`` (default: here); with several workloads, each file's name ends in its workload
    (``-W16.json``)."""
    from kvlab.bench.vllm_results import result_path, write_result

    several = len(results) > 1
    return [write_result(data, result_path(name, result_dir, workload, several)) for workload, data in results.items()]


def compare_files(out: Console, results: dict[str, dict[str, Any]], files: list[Path]) -> None:
    """``--compare``: each file (vllm bench serve's result, or kvlab's --save-result) beside the workload of this
    run that sent as many requests."""
    from kvlab.bench.vllm_results import ResultFile, ResultFileError, compare_table, matching

    ours = [ResultFile(Path(workload), data) for workload, data in results.items()]
    for path in files:
        try:
            theirs = ResultFile.read(path)
            render(out, compare_table(matching(ours, theirs), theirs))
        except ResultFileError as exc:
            fail(str(exc))


def bench_serve(
    base_url: Annotated[str, typer.Option(help="Server root or its /v1 URL, e.g. http://127.0.0.1:8000/v1")],
    model: ModelOption = "mini",
    served_model: Annotated[
        str | None,
        typer.Option("--served-model-name", help="Model name sent to the server (default: the first id of /v1/models)"),
    ] = None,
    requests: Annotated[
        str | None,
        typer.Option(
            callback=check_requests,
            metavar="N,...",
            help="Comma-separated prompt sets W<N> (workload sizes N); default 16,64, or W<num-prompts> with "
            "--num-prompts",
        ),
    ] = None,
    num_prompts: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Requests per workload, cycling through its prompts (request k sends prompt k mod N); default: "
            "each prompt once",
        ),
    ] = None,
    request_rate: Annotated[
        float,
        typer.Option(
            callback=check_request_rate,
            help="Requests per second, Poisson arrivals seeded with --seed; inf: all at once",
        ),
    ] = float("inf"),
    max_concurrency: Annotated[
        int | None, typer.Option(min=1, help="Most requests in flight at once (default: no limit)")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the Poisson arrival times")] = 0,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    prompt_format: Annotated[
        PromptFormat,
        typer.Option(help="token-ids: the prompts' token ids; text: their decoded text (servers refusing token lists)"),
    ] = "token-ids",
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos/--no-ignore-eos",
            help="Send ignore_eos: every request makes --max-tokens tokens on every server (on by default, unlike "
            "vllm bench serve; off: servers refusing it)",
        ),
    ] = True,
    timeout: Annotated[float, typer.Option(min=0.001, help="Seconds each request may take in total")] = 600.0,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds per workload; the best wall time counts")] = 1,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="One unmeasured 2-prompt round first")] = True,
    api_key: Annotated[str | None, typer.Option(help="Sent as 'Authorization: Bearer KEY'")] = None,
    json_out: JsonOption = None,
    save_result: Annotated[
        bool,
        typer.Option(
            "--save-result",
            help="Also save each workload's result as vllm bench serve writes it (its layout and file name, "
            "per-request lists included)",
        ),
    ] = False,
    compare: Annotated[
        list[Path] | None,
        typer.Option(
            metavar="FILE",
            exists=True,
            dir_okay=False,
            help="A vllm bench serve result (or kvlab's --save-result) to print beside this run; repeatable",
        ),
    ] = None,
    result_dir: Annotated[
        Path | None,
        typer.Option(metavar="DIR", callback=writable_folder, help="--save-result: directory (default: here)"),
    ] = None,
    result_filename: Annotated[
        str | None,
        typer.Option(help="--save-result: file name (default: kvlab-{rate}qps[-concurrency{N}]-{model}-{date}.json)"),
    ] = None,
) -> None:
    """The shared-prefix prompts of `bench throughput` as streaming /v1/completions requests to any
    OpenAI-compatible server (greedy, EOS ignored), in vllm bench serve's terms: --num-prompts requests per
    prompt set, at --request-rate (Poisson) with at most --max-concurrency in flight. Reports TTFT, TPOT, ITL
    and E2E mean / median / p99, request and output throughput, the concurrency reached, failures. --model
    only supplies the tokenizer and prompts. Exits 1 when a measured request failed."""
    from kvlab.bench.serve import ServeBenchError, serve_workload
    from kvlab.bench.serve import bench_serve as run_bench

    out = out_console(json_out)  # with --json -, stdout carries the JSON alone: the tables go to stderr
    loaded = load_or_exit(model)
    workloads = [serve_workload(loaded, n) for n in workload_sizes(requests, num_prompts)]
    date = now()
    try:
        bench = run_bench(
            base_url,
            workloads,
            max_tokens,
            served_model=served_model,
            prompt_format=prompt_format,
            ignore_eos=ignore_eos,
            timeout=timeout,
            repeats=repeats,
            warmup=warmup,
            api_key=api_key,
            num_prompts=num_prompts,
            request_rate=request_rate,
            max_concurrency=max_concurrency,
            seed=seed,
        )
    except ServeBenchError as exc:
        fail(str(exc))
    if bench.warmup is not None and bench.warmup.failed:
        first = bench.warmup.failed[0]
        out.print(f"[yellow]warm-up:[/yellow] {len(bench.warmup.failed)} of {len(bench.warmup.requests)} failed")
        out.print(first.error, markup=False, highlight=False)

    for r in bench.results:
        print_result(out, r)
    out.print(METHOD_LINE, highlight=False)
    data: dict[str, Any] = {"date": date, **bench.as_dict()}
    if save_result or compare:
        from kvlab.bench.serve import result_filename as default_name
        from kvlab.bench.vllm_results import vllm_result

        # Each workload in vllm bench serve's layout, built once for the files and the comparison.
        tokenizer_id = str(loaded.source or loaded.name)
        flat = {r.workload: vllm_result(r, date=date, tokenizer_id=tokenizer_id) for r in bench.results}
        if save_result:
            name = result_filename or default_name(bench.served_model, request_rate, max_concurrency, date)
            for path in save_result_files(flat, name, result_dir):
                out.print(f"saved {path}", highlight=False)
        if compare:
            compare_files(out, flat, compare)
    dump_json(json_out, data)
    if bench.failed:
        raise typer.Exit(1)
