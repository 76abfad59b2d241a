"""``kvlab bench throughput|fidelity|sweep|layout|memory|step|cow``: every benchmark prints ratios against a peer
measured in the same run; ``kvlab bench serve`` measures any OpenAI-compatible server from the client. Heavy
imports wait until a command runs, so ``kvlab --help`` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_args

import typer

from kvlab.bench.names import COW_WORKLOADS, THROUGHPUT_WORKLOADS
from kvlab.bench.peers import PEERS
from kvlab.bench.serve_results import PromptFormat
from kvlab.cli.bench_kv import BlockSizesOption, CliffStrategiesOption, GranularitiesOption, WorkloadsOption
from kvlab.cli.bench_manager import bench_manager
from kvlab.cli.bench_modes import ModesOption, modes_of
from kvlab.cli.bench_scaling import bench_scaling
from kvlab.cli.bench_serve import check_request_rate, check_requests, workload_sizes
from kvlab.cli.bench_tenants import bench_tenants
from kvlab.cli.common import (
    DtypeName,
    JsonOption,
    ModelOption,
    ThreadsOption,
    check_int_list,
    dump_json,
    fail,
    int_list,
    list_callback,
    load_or_exit,
    name_list,
    names_option,
    out_console,
    parsed_list,
    render,
    set_threads,
)
from kvlab.config import QUANTIZATION_MODES, CacheConfig, SchedulerConfig

if TYPE_CHECKING:
    pass

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against peers measured in the same run.")


@bench_app.command("throughput")
def bench_throughput(
    model: ModelOption = "mini",
    workloads: Annotated[
        str,
        names_option(
            THROUGHPUT_WORKLOADS,
            "workloads",
            "Comma-separated workloads, run in this order (shared-prefix: W<N> for each N of --requests)",
        ),
    ] = "shared-prefix",
    requests: Annotated[
        str, typer.Option(callback=check_int_list, help="shared-prefix: comma-separated workload sizes N (W<N>)")
    ] = "16,64",
    distinct_requests: Annotated[
        int, typer.Option(min=1, help="no-sharing: distinct prompts (200 tokens each, no common prefix)")
    ] = 32,
    long_requests: Annotated[int, typer.Option(min=1, help="long-context: questions over the one document")] = 8,
    document_tokens: Annotated[
        int, typer.Option(min=16, help="long-context: the document's tokens (cut to the model's positions)")
    ] = 2000,
    sessions: Annotated[int, typer.Option(min=1, help="chat: sessions")] = 8,
    turns: Annotated[int, typer.Option(min=1, help="chat: turns per session, issued in rounds")] = 4,
    n: Annotated[int, typer.Option(min=2, help="parallel: samples per prompt (temperature 1, top_k 1)")] = 4,
    parallel_requests: Annotated[int, typer.Option(min=1, help="parallel: W<N>'s N, prompts sampled n times")] = 16,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    threads: ThreadsOption = None,
    modes: ModesOption = "fp32",
    peers: Annotated[
        str, names_option(PEERS, "peers", "Comma-separated peers ('': kvlab's modes alone)", allow_empty=True)
    ] = "hf-generate,hf-generate-batch,llama.cpp",
    repeats: Annotated[int, typer.Option(min=1, help="Runs per peer; the fastest counts")] = 1,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, help="Token budget per step (kvlab and HF CB)")
    ] = SchedulerConfig.max_num_batched_tokens,
    vllm_python: Annotated[
        str | None,
        typer.Option(help="vLLM's interpreter for --peers vllm,vllm-bf16 (default: $KVLAB_VLLM_PYTHON, vllm.sh's)"),
    ] = None,
    vllm_model: Annotated[
        str | None,
        typer.Option(help="What vLLM loads: an HF directory of the same weights (smollm2: the one vllm.sh writes)"),
    ] = None,
    json_out: JsonOption = None,
) -> None:
    """Serving throughput, 32 tokens per sequence with EOS ignored, on each of --workloads: shared-prefix (W<N>:
    N requests, one ~100-token system prompt), no-sharing (32 distinct 200-token prompts), long-context (8
    questions over one ~2,000-token document), chat (8 sessions x 4 turns in rounds, each turn's prompt
    extending the last one's with a scripted answer) and parallel (W16 with n=4 samples per prompt). Greedy,
    but parallel: temperature 1 with top_k 1, the argmax by sampling, since vLLM refuses n > 1 greedy. Every
    kvlab mode and every peer run in the same process, one after another; vLLM (--peers vllm,vllm-bf16) runs in
    its own interpreter, one worker process per dtype kvlab drives over JSON."""
    from kvlab.bench.modes import ModelsByDtype
    from kvlab.bench.peers import PeerError, hf_peer_model, plan_peers
    from kvlab.bench.throughput import compare_throughput, throughput_table
    from kvlab.bench.vllm_peer import VLLMPeerError
    from kvlab.bench.workloads import WorkloadError, WorkloadSizes

    out = out_console(json_out)
    mode_list = modes_of(model, modes)
    try:
        plan = plan_peers(model, name_list(peers, PEERS, "peers", allow_empty=True), vllm_python, vllm_model)
    except PeerError as exc:
        fail(str(exc))
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    for peer, why in plan.skipped:
        out.print(f"[yellow]{peer} skipped:[/yellow] {why}")
    try:
        rows = compare_throughput(
            loaded,
            int_list(requests),
            max_tokens,
            plan.peers,
            hf_model=hf_peer_model(plan, loaded),
            gguf=plan.gguf,
            threads=n_threads,
            repeats=repeats,
            max_num_batched_tokens=max_num_batched_tokens,
            modes=mode_list,
            model_in=ModelsByDtype(model, {"float32": loaded}),
            vllm_python=plan.vllm_python,
            vllm_model=plan.vllm_model,
            workloads=name_list(workloads, THROUGHPUT_WORKLOADS, "workloads"),
            workload_sizes=WorkloadSizes(
                distinct_requests=distinct_requests,
                long_requests=long_requests,
                document_tokens=document_tokens,
                sessions=sessions,
                turns=turns,
                n=n,
                parallel_requests=parallel_requests,
            ),
        )
    except VLLMPeerError as exc:
        fail(f"the vllm peer: {exc}", code=1)
    except WorkloadError as exc:
        fail(str(exc))
    render(out, throughput_table(rows, loaded.name, max_tokens, n_threads))
    dump_json(json_out, [row.as_dict() for row in rows])


QUANTIZATIONS = ("none", *QUANTIZATION_MODES)  # "none": ModeConfig.quantization=None, the model's own weights
MODEL_DTYPES = tuple(d for d in get_args(DtypeName) if d != "auto")  # what a model is loaded in


@bench_app.command("fidelity")
def bench_fidelity(
    model: ModelOption = "mini",
    dtype: Annotated[str, names_option(MODEL_DTYPES, "dtypes", "Comma-separated model dtypes")] = "float32",
    quantization: Annotated[
        str,
        names_option(
            QUANTIZATIONS,
            "quantization modes",
            "Comma-separated weight-only quantisations (bf16 activations; gguf: the file's Q4_1; none: the weights "
            "as they are)",
        ),
    ] = "none,int8,int4,gguf",
    requests: Annotated[int, typer.Option(min=1, help="W<N>: the throughput benchmark's prompts")] = 16,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    hf: Annotated[bool, typer.Option("--hf/--no-hf", help="Also compare gguf modes with transformers")] = True,
    threads: ThreadsOption = None,
    json_out: JsonOption = None,
) -> None:
    """Each mode (dtype x quantization) against fp32 on the W<N> prompts: requests whose greedy tokens are all
    identical, first-divergence p50, max |logit difference| over every prompt position; gguf modes also against
    HF transformers' dequantised model of the same file."""
    from kvlab.bench.fidelity import Mode, fidelity_table, measure_fidelity
    from kvlab.bench.peers import gguf_of
    from kvlab.config import ConfigError

    out = out_console(json_out)
    dtypes = name_list(dtype, MODEL_DTYPES, "dtypes")
    quants = name_list(quantization, QUANTIZATIONS, "quantization modes")
    if "gguf" in quants and gguf_of(model) is None:
        out.print(f"[yellow]gguf skipped:[/yellow] {model!r} is not a GGUF file (int8 and int4 quantise any model)")
        quants.remove("gguf")
    modes = [Mode(d, None if q == "none" else q) for d in dtypes for q in quants]
    reference = load_or_exit(model)
    n_threads = set_threads(threads, reference)
    try:
        rows = measure_fidelity(model, modes, requests, max_tokens, against_hf=hf, reference=reference)
    except ConfigError as exc:
        fail(str(exc))
    render(out, fidelity_table(rows, model, requests, max_tokens, n_threads))
    dump_json(json_out, [r.as_dict() for r in rows])


@bench_app.command("sweep")
def bench_sweep(
    model: ModelOption = "mini",
    requests: Annotated[int, typer.Option(min=1, help="Requests in the burst (shared-prefix workload)")] = 128,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    max_num_seqs: Annotated[
        str, typer.Option(callback=check_int_list, help="Comma-separated max_num_seqs values")
    ] = "8,16,32,64,128",
    max_num_batched_tokens: Annotated[
        str,
        typer.Option(callback=check_int_list, help="Comma-separated token budgets (run at the knee's max_num_seqs)"),
    ] = "64,128,256,512,1024,2048",
    threads: ThreadsOption = None,
    plot: Annotated[Path, typer.Option(help="PNG of throughput and latency")] = Path("sweep.png"),
    json_out: JsonOption = None,
    block_sizes: BlockSizesOption = None,
    workload: WorkloadsOption = "short,long",
    granularity: GranularitiesOption = "token,block",
    block_requests: Annotated[
        int | None, typer.Option(min=1, help="Block-size sweep: requests per workload (default: short 256, long 16)")
    ] = None,
    cliff: Annotated[
        bool,
        typer.Option("--cliff", help="Run the concurrency sweep against a fixed KV pool, not the scheduler sweep"),
    ] = False,
    concurrency: Annotated[
        str, typer.Option(callback=check_int_list, help="Cliff: comma-separated numbers of concurrent requests")
    ] = "1,2,4,8,16,32",
    kv_blocks: Annotated[int, typer.Option(min=2, help="Cliff: blocks of 16 tokens in the KV pool")] = 64,
    strategies: CliffStrategiesOption = "isolated,shared-cow",
    rounds: Annotated[int, typer.Option(min=1, help="Cliff: requests each client sends, one after another")] = 4,
    repeats: Annotated[
        int, typer.Option(min=1, help="Block-size and cliff sweeps: runs per point; the fastest counts")
    ] = 1,
) -> None:
    """Throughput and p50/p99 latency over max_num_seqs, then over max_num_batched_tokens; finds the knee.

    --block-sizes: per block size, internal fragmentation, time in the KV manager and in building block tables
    per step, prefix-hit tokens lost to block granularity, throughput (short and long workloads). --cliff:
    concurrency against a fixed KV pool, with and without prefix sharing: knee, cliff, and per-step attribution
    (preemptions, recomputed tokens, copies, evictions, KV usage, tokens per step). Either or both replace the
    scheduler sweep."""
    if block_sizes is not None or cliff:
        from kvlab.cli.bench_kv import run_kv_sweeps

        run_kv_sweeps(
            model=model,
            threads=threads,
            block_sizes=block_sizes,
            workloads=workload,
            granularities=granularity,
            block_requests=block_requests,
            cliff=cliff,
            concurrency=concurrency,
            kv_blocks=kv_blocks,
            strategies=strategies,
            rounds=rounds,
            repeats=repeats,
            plot=plot,
            json_out=json_out,
        )
        return
    from kvlab.bench.sweep import find_knee, plot_sweep, run_point, sweep_table
    from kvlab.bench.workloads import shared_prefix_prompts

    out = out_console(json_out)
    seqs, budgets = int_list(max_num_seqs), int_list(max_num_batched_tokens)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    prompts = shared_prefix_prompts(loaded, requests)
    run_point(loaded, prompts[:2], 2, 2, 256)  # warm-up
    seq_points = [run_point(loaded, prompts, max_tokens, s, max(budgets)) for s in seqs]
    knee = find_knee(seq_points)
    at = knee.max_num_seqs if knee is not None else max(seqs)
    token_points = [run_point(loaded, prompts, max_tokens, at, b) for b in budgets]
    render(out, sweep_table(seq_points, token_points, knee, loaded.name, requests, max_tokens, n_threads))
    plot_sweep(seq_points, token_points, knee, f"kvlab bench sweep: {loaded.name}, {requests} requests", plot)
    out.print(f"wrote {plot}")
    dump_json(
        json_out,
        {
            "knee_max_num_seqs": None if knee is None else knee.max_num_seqs,
            "max_num_seqs": [p.as_dict() for p in seq_points],
            "max_num_batched_tokens": [p.as_dict() for p in token_points],
        },
    )


@bench_app.command("layout")
def bench_layout(
    model: ModelOption = "mini",
    batches: Annotated[
        str, typer.Option(callback=check_int_list, help="Comma-separated decode batch sizes")
    ] = "1,8,32,64",
    contexts: Annotated[str, typer.Option(callback=check_int_list, help="Comma-separated context lengths")] = (
        "128,512,2048"
    ),
    threads: ThreadsOption = None,
    min_run_time: Annotated[float, typer.Option(min=0.01, help="Seconds of repeats per figure")] = 0.2,
    json_out: JsonOption = None,
) -> None:
    """NHD vs HND cache layout: decode writes and decode reads (gather + attention), one layer."""
    from kvlab.bench.layout import compare_layouts, layout_table

    out = out_console(json_out)
    batch_list, context_list = int_list(batches), int_list(contexts)
    loaded = load_or_exit(model)
    cfg = loaded.config
    n_threads = set_threads(threads, loaded)
    rows = compare_layouts(
        batch_list, context_list, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads, min_run_time=min_run_time
    )
    render(out, layout_table(rows, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads, n_threads))
    dump_json(json_out, [r.as_dict() for r in rows])


def sharing_cases(text: str) -> list[tuple[int, int, int]]:
    """``--sharing``: comma-separated N:P:S triples of positive integers; ``typer.BadParameter`` otherwise."""

    def case(item: str) -> tuple[int, int, int]:
        try:
            n, p, s = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"expected N:P:S triples of positive integers, got {text!r}") from None
        if min(n, p, s) < 1:
            raise ValueError(f"expected N:P:S triples of positive integers, got {text!r}")
        return n, p, s

    return parsed_list(text, case, "N:P:S triples")


@bench_app.command("memory")
def bench_memory(
    preset: Annotated[str, typer.Option(help="KV shape preset for the byte figures")] = "smollm2-135m",
    dtype: Annotated[str, typer.Option(help="KV element type for the byte figures")] = "fp16",
    sequences: Annotated[int, typer.Option(min=1, help="Sequences in the mixed-length workload")] = 64,
    max_seq_len: Annotated[int, typer.Option(min=32, help="What a contiguous cache reserves per sequence")] = 2048,
    block_size: Annotated[int, typer.Option(min=1)] = CacheConfig.block_size,
    sharing: Annotated[
        str,
        typer.Option(
            callback=list_callback(sharing_cases),
            help="Comma-separated N:P:S cases: N requests, P shared, S distinct tokens",
        ),
    ] = "16:100:20,64:100:20,8:1000:50,32:7:20",
    json_out: JsonOption = None,
) -> None:
    """Measured through the block manager: paged vs contiguous on mixed lengths; prefix-sharing savings."""
    from kvlab.bench.memory_use import measure_paging, measure_sharing, mixed_lengths, paging_table, sharing_table
    from kvlab.memory import MemoryInputError, get_preset

    out = out_console(json_out)
    try:
        shape = get_preset(preset)
    except MemoryInputError as exc:
        raise typer.BadParameter(str(exc), param_hint="--preset") from exc
    paging = measure_paging(mixed_lengths(sequences, max_seq_len), block_size, max_seq_len, shape, dtype)
    render(out, paging_table(paging, shape.name, dtype))
    shares = [measure_sharing(n, p, suffix, block_size) for n, p, suffix in sharing_cases(sharing)]
    render(out, sharing_table(shares, block_size))
    dump_json(json_out, {"paging": paging.as_dict(), "sharing": [m.as_dict() for m in shares]})


@bench_app.command("step")
def bench_step(
    model: ModelOption = "mini",
    batches: Annotated[
        str, typer.Option(callback=check_int_list, help="Comma-separated decode batch sizes")
    ] = "1,16,32,64",
    context: Annotated[int, typer.Option(min=1, help="Prompt tokens of each request")] = 128,
    steps: Annotated[int, typer.Option(min=1, help="Timed decode steps (median); the modes take turns")] = 8,
    threads: ThreadsOption = None,
    modes: ModesOption = "fp32",
    profile: Annotated[int | None, typer.Option(help="Also print a torch.profiler table at this batch")] = None,
    json_out: JsonOption = None,
) -> None:
    """Decode step vs bare model forward, per mode, against that mode's roofline: its arithmetic at the best
    matmul rate in its dtype, or its weights (as the mode stores them) at the memory bandwidth, whichever is
    longer."""

    from kvlab.bench.modes import ModelsByDtype
    from kvlab.bench.step import decode_step_timings, matmul_peaks, memory_bandwidth, profile_decode, step_table

    out = out_console(json_out)
    mode_list = modes_of(model, modes)
    batch_list = int_list(batches)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    model_in = ModelsByDtype(model, {"float32": loaded})
    peaks = matmul_peaks(m.dtype for m in mode_list)
    bandwidth = memory_bandwidth()
    rows = [t for b in batch_list for t in decode_step_timings(model_in, mode_list, b, context, steps)]
    dtype_of = {m.name: m.dtype for m in mode_list}
    floors = [r.roofline_ms(peaks[dtype_of[r.mode]], bandwidth) for r in rows]
    render(out, step_table(rows, floors, peaks, bandwidth, loaded.name, n_threads))
    if profile is not None:
        out.print(profile_decode(model_in(mode_list[0].dtype), profile, context, mode=mode_list[0]))
    steps_out = [
        r.as_dict() | {"roofline_ms": floor, "step_over_roofline": r.step_ms / floor}
        for r, floor in zip(rows, floors, strict=True)
    ]
    dump_json(json_out, {"matmul_peak_gflops": peaks, "memory_gbps": bandwidth, "steps": steps_out})


@bench_app.command("cow")
def bench_cow(
    model: ModelOption = "mini",
    workloads: Annotated[str, names_option(COW_WORKLOADS, "workloads")] = "passphrase,fork,chat",
    trials: Annotated[int, typer.Option(min=1, help="passphrase: trials of 2 concurrent requests")] = 100,
    requests: Annotated[int, typer.Option(min=1, help="fork: shared-prefix prompts")] = 32,
    n: Annotated[int, typer.Option(min=2, help="fork: samples per prompt (forks at the first token)")] = 4,
    sessions: Annotated[int, typer.Option(min=1, help="chat: concurrent sessions")] = 8,
    turns: Annotated[int, typer.Option(min=1, help="chat: turns per session")] = 6,
    max_tokens: Annotated[int, typer.Option(min=1, help="fork and chat: tokens per answer")] = 16,
    block_size: Annotated[int, typer.Option(min=1)] = CacheConfig.block_size,
    num_blocks: Annotated[int, typer.Option(min=2)] = CacheConfig.num_blocks,
    repeats: Annotated[int, typer.Option(min=1, help="Runs per mode, taking turns; the fastest counts")] = 3,
    threads: ThreadsOption = None,
    json_out: JsonOption = None,
) -> None:
    """Copy-on-write decided at the write or at allocation (cow_check=write|allocate) on three workloads: copies
    made, made at allocation, not needed, extra against write, bytes copied, time in the KV manager and in
    the copies per step, total time. Both modes must give the same tokens (exit 1 otherwise)."""
    from kvlab.bench.cow import CowSizes, compare_cow_checks, cow_table
    from kvlab.config import ConfigError

    out = out_console(json_out)
    try:
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    names = name_list(workloads, COW_WORKLOADS, "workloads")
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    sizes = CowSizes(trials=trials, requests=requests, n=n, sessions=sessions, turns=turns, max_tokens=max_tokens)
    rows = compare_cow_checks(loaded, names, sizes, cache, repeats=repeats)
    render(out, cow_table(rows, loaded.name, block_size, num_blocks, n_threads, repeats))
    dump_json(json_out, [row.as_dict() for row in rows])
    bad = [row for row in rows if not row.identical]
    for row in bad:
        shown = ", ".join(row.mismatches[:5]) + (" ..." if len(row.mismatches) > 5 else "")
        out.print(
            f"[red bold]MISMATCH[/red bold] {row.workload}: {len(row.mismatches)} request(s) got different tokens "
            f"under cow_check=write and allocate: {shown}"
        )
    if bad:
        raise typer.Exit(1)


@bench_app.command("serve")
def bench_serve(
    base_url: Annotated[str, typer.Option(help="Server root or its /v1 URL, e.g. http://127.0.0.1:8000/v1")],
    model: ModelOption = "mini",
    served_model: Annotated[
        str | None, typer.Option(help="Model name sent to the server (default: the first id of /v1/models)")
    ] = None,
    requests: Annotated[
        str | None,
        typer.Option(
            callback=check_requests,
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
        bool, typer.Option("--ignore-eos/--no-ignore-eos", help="Send ignore_eos (off: servers refusing it)")
    ] = True,
    timeout: Annotated[float, typer.Option(min=0.001, help="Seconds each request may take in total")] = 600.0,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds per workload; the best wall time counts")] = 1,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="One unmeasured 2-prompt round first")] = True,
    api_key: Annotated[str | None, typer.Option(help="Sent as 'Authorization: Bearer KEY'")] = None,
    json_out: JsonOption = None,
    save_result: Annotated[
        bool, typer.Option("--save-result", help="Also save the result JSON as vllm bench serve names it")
    ] = False,
    result_dir: Annotated[Path | None, typer.Option(help="--save-result: directory (default: here)")] = None,
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
    from kvlab.cli.bench_serve import METHOD_LINE, now, print_result
    from kvlab.cli.bench_serve import save_result as save

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
    if save_result:
        path = save(data, bench.served_model, request_rate, max_concurrency, result_dir, result_filename)
        out.print(f"saved {path}", highlight=False)
    dump_json(json_out, data)
    if bench.failed:
        raise typer.Exit(1)


bench_app.command("manager")(bench_manager)

bench_app.command("tenants")(bench_tenants)

bench_app.command("scaling")(bench_scaling)
