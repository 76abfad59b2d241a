"""``kvlab bench throughput|fidelity|sweep|layout|memory|step|cow``: every benchmark prints ratios against a peer
measured in the same run; ``kvlab bench serve`` measures any OpenAI-compatible server from the client. Heavy
imports wait until a command runs, so ``kvlab --help`` stays fast."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvlab.cli.bench_kv import check_block_sizes, check_granularities, check_strategies, check_workloads
from kvlab.cli.bench_serve import check_request_rate, check_requests, workload_sizes
from kvlab.cli.common import (
    JsonOption,
    ModelOption,
    ThreadsOption,
    check_int_list,
    console,
    dump_json,
    int_list,
    load_or_exit,
    set_threads,
)
from kvlab.config import QUANTIZATION_MODES, CacheConfig, SchedulerConfig

if TYPE_CHECKING:
    from kvlab.bench.modes import Mode

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against peers measured in the same run.")


def _modes_of(model: str, text: str) -> list[Mode]:
    """The modes of ``text``, or exit 2 before any model loads when one cannot apply to ``model``."""
    from kvlab.bench.modes import parse_modes
    from kvlab.config import ConfigError

    try:
        modes = parse_modes(text)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--modes") from exc
    if any(m.quantization == "gguf" for m in modes) and _gguf_of(model) is None:
        console.print(f"[red]error:[/red] the gguf mode keeps a GGUF file's own codes; {model!r} is not a GGUF")
        raise typer.Exit(2)
    return modes


ModesOption = Annotated[
    str,
    typer.Option(
        help="Comma-separated kvlab modes, each '+'-joined words: fp32|bf16 (model dtype), int8|int4|gguf "
        "(weight-only quantisation), cpp (compiled CPU kernels: in-place paged attention, fused norms/RoPE/SiLU), "
        "kv-bf16|kv-fp32 (KV cache dtype); "
        "e.g. fp32,fp32+cpp,bf16+cpp"
    ),
]


@bench_app.command("throughput")
def bench_throughput(
    model: ModelOption = "mini",
    requests: Annotated[
        str, typer.Option(callback=check_int_list, help="Comma-separated workload sizes N (W<N>)")
    ] = "16,64",
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    threads: ThreadsOption = None,
    modes: ModesOption = "fp32",
    peers: Annotated[
        str,
        typer.Option(help="Comma-separated: hf-generate, hf-generate-bf16, hf-generate-batch, llama.cpp, vllm"),
    ] = "hf-generate,hf-generate-batch,llama.cpp",
    repeats: Annotated[int, typer.Option(min=1, help="Runs per peer; the fastest counts")] = 1,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, help="Token budget per step (kvlab and HF CB)")
    ] = SchedulerConfig.max_num_batched_tokens,
    vllm_python: Annotated[
        str | None,
        typer.Option(help="vLLM's interpreter for --peers vllm (default: $KVLAB_VLLM_PYTHON, scripts/peers/vllm.sh's)"),
    ] = None,
    vllm_model: Annotated[
        str | None,
        typer.Option(help="What vLLM loads: an HF directory of the same weights (smollm2: the one vllm.sh writes)"),
    ] = None,
    json_out: JsonOption = None,
) -> None:
    """Shared-prefix throughput: N requests, one ~100-token system prompt, 32 greedy tokens each, EOS ignored.
    Every kvlab mode and every peer run in the same process, one after another; vLLM (--peers vllm) runs in
    its own interpreter, a worker process kvlab drives over JSON."""
    from rich.table import Table

    from kvlab.bench.modes import ModelsByDtype
    from kvlab.bench.throughput import PEERS, compare_throughput, llama_cpp_available

    mode_list = _modes_of(model, modes)
    wanted = [p.strip() for p in peers.split(",") if p.strip()]
    if bad := sorted(set(wanted) - set(PEERS)):
        console.print(f"[red]error:[/red] unknown peer(s) {bad}; known: {', '.join(PEERS)}")
        raise typer.Exit(2)
    if "vllm" in wanted:
        from kvlab.bench.vllm_peer import default_vllm_model, default_vllm_python

        vllm_python = vllm_python or default_vllm_python()
        if vllm_python is None:
            console.print("[red]error:[/red] --peers vllm needs --vllm-python (scripts/peers/vllm.sh makes one)")
            raise typer.Exit(2)
        vllm_model = vllm_model or default_vllm_model(model)
        if vllm_model is None or not Path(vllm_model).expanduser().is_dir():
            console.print(
                f"[red]error:[/red] --peers vllm needs --vllm-model: an HF directory of {model}'s weights "
                f"({vllm_model or 'none'} is not one; scripts/peers/vllm.sh writes smollm2's)"
            )
            raise typer.Exit(2)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    gguf = _gguf_of(model)
    if "llama.cpp" in wanted and not (llama_cpp_available() and gguf is not None):
        why = "llama-cpp-python is not installed" if not llama_cpp_available() else "the model is not a GGUF file"
        console.print(f"[yellow]llama.cpp skipped:[/yellow] {why} (kvlab never installs it)")
        wanted.remove("llama.cpp")
    hf_model = None
    if {"hf-generate", "hf-generate-bf16", "hf-generate-batch"} & set(wanted):
        from kvlab.bench.peers import hf_from_gguf, hf_llama_from

        hf_model = hf_from_gguf(gguf) if gguf is not None else hf_llama_from(loaded.model)
    from kvlab.bench.vllm_peer import VLLMPeerError

    try:
        rows = compare_throughput(
            loaded,
            int_list(requests),
            max_tokens,
            wanted,
            hf_model=hf_model,
            gguf=gguf,
            threads=n_threads,
            repeats=repeats,
            max_num_batched_tokens=max_num_batched_tokens,
            modes=mode_list,
            model_in=ModelsByDtype(model, {"float32": loaded}),
            vllm_python=vllm_python,
            vllm_model=vllm_model,
        )
    except VLLMPeerError as exc:
        console.print(f"[red]error:[/red] the vllm peer: {exc}")
        raise typer.Exit(1) from None
    baseline = "HF generate fp32" if "hf-generate" in wanted else f"kvlab {mode_list[0].name}"
    table = Table(title=f"throughput: {loaded.name}, {max_tokens} greedy tokens/request, {n_threads} threads")
    columns = ("workload", "peer", "seconds", "output tok/s", f"x {baseline}", f"kvlab {mode_list[0].name} speed-up")
    for col in (*columns, "identical", "common prefix", "resident MiB", "setup"):
        table.add_column(col)
    for row in rows:
        r = row.result
        table.add_row(
            row.workload,
            r.name,
            f"{r.seconds:.2f}",
            f"{r.tokens_per_second:.1f}",
            f"{row.vs_baseline:.2f}x",
            f"{row.vs_kvlab:.2f}x",
            "-" if row.identical is None else f"{row.identical}/{len(r.tokens)}",
            "-" if row.common_prefix is None else f"{row.common_prefix:.1f}",
            "-" if r.resident_mib is None else f"{r.resident_mib:.0f}",
            r.setup,
        )
    console.print(table)
    console.print(
        "identical / common prefix: against the first kvlab mode; resident MiB: the engine's weights (packed and "
        "quantised copies included) plus its KV pool"
    )
    dump_json(json_out, [row.as_dict() for row in rows])


def _gguf_of(model: str) -> Path | None:
    if model == "smollm2":
        from kvlab.model.gguf import smollm2_gguf_path

        return smollm2_gguf_path()
    return Path(model) if model.endswith(".gguf") else None


QUANTIZATIONS = ("none", *QUANTIZATION_MODES)  # "none": ModeConfig.quantization=None, the model's own weights


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated list of names from ``allowed``; ``typer.BadParameter`` names what is wrong."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or set(names) - set(allowed):
        raise typer.BadParameter(f"expected comma-separated {what} from {', '.join(allowed)}, got {text!r}")
    return list(dict.fromkeys(names))


def _check_quantizations(text: str) -> str:
    _names(text, QUANTIZATIONS, "quantization modes")
    return text


QuantizationListOption = Annotated[
    str,
    typer.Option(
        callback=_check_quantizations,
        help="none | int8 | int4 | gguf (weight-only quantised linears, bf16 activations; gguf: the file's Q4_1)",
    ),
]


@bench_app.command("fidelity")
def bench_fidelity(
    model: ModelOption = "mini",
    dtype: Annotated[str, typer.Option(help="Comma-separated model dtypes: float32, bfloat16")] = "float32",
    quantization: QuantizationListOption = "none,int8,int4,gguf",
    requests: Annotated[int, typer.Option(min=1, help="W<N>: the throughput benchmark's prompts")] = 16,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    hf: Annotated[bool, typer.Option("--hf/--no-hf", help="Also compare gguf modes with transformers")] = True,
    threads: ThreadsOption = None,
    json_out: JsonOption = None,
) -> None:
    """Each mode (dtype x quantization) against fp32 on the W<N> prompts: requests whose greedy tokens are all
    identical, first-divergence p50, max |logit difference| over every prompt position; gguf modes also against
    HF transformers' dequantised model of the same file."""
    from rich.table import Table

    from kvlab.bench.fidelity import Mode, measure_fidelity
    from kvlab.config import ConfigError

    dtypes = _names(dtype, ("float32", "bfloat16"), "dtypes")
    quants = _names(quantization, QUANTIZATIONS, "quantization modes")
    if "gguf" in quants and _gguf_of(model) is None:
        console.print(f"[yellow]gguf skipped:[/yellow] {model!r} is not a GGUF file (int8 and int4 quantise any model)")
        quants.remove("gguf")
    modes = [Mode(d, None if q == "none" else q) for d in dtypes for q in quants]
    reference = load_or_exit(model)
    n_threads = set_threads(threads, reference)
    try:
        rows = measure_fidelity(model, modes, requests, max_tokens, against_hf=hf, reference=reference)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    table = Table(title=f"fidelity: {model}, W{requests}, {max_tokens} greedy tokens/request, {n_threads} threads")
    for col in ("mode", "reference", "identical", "first divergence p50", "max |Δlogit| (prompt)", "top-1 agree"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.mode,
            r.reference,
            f"{r.identical}/{r.requests} ({r.identical_fraction:.0%})",
            f"{r.first_divergence_p50:.1f}" + ("+" if r.first_divergence_p50 >= max_tokens else ""),
            f"{r.max_logit_diff:.4f}",
            f"{r.prompt_argmax_agreement:.3f}",
        )
    console.print(table)
    console.print(
        f"first divergence: position of the first differing token, an identical request counting as {max_tokens}; "
        "quantised linears run with bf16 activations in every dtype (kvlab.model.quant)"
    )
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
    block_sizes: Annotated[
        str | None,
        typer.Option(
            callback=check_block_sizes,
            help="Comma-separated block sizes, e.g. 8,16,32: run the block-size sweep instead of the scheduler sweep",
        ),
    ] = None,
    workload: Annotated[
        str, typer.Option(callback=check_workloads, help="Block-size sweep: comma-separated short | long")
    ] = "short,long",
    granularity: Annotated[
        str, typer.Option(callback=check_granularities, help="Block-size sweep: prefix granularities token | block")
    ] = "token,block",
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
    strategies: Annotated[
        str,
        typer.Option(
            callback=check_strategies,
            help="Cliff: comma-separated strategies (isolated: no sharing; shared-cow: sharing; shared-no-cow: unsafe)",
        ),
    ] = "isolated,shared-cow",
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
    from rich.table import Table

    from kvlab.bench.sweep import find_knee, plot_sweep, run_point
    from kvlab.bench.throughput import shared_prefix_prompts

    seqs, budgets = int_list(max_num_seqs), int_list(max_num_batched_tokens)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    prompts = shared_prefix_prompts(loaded, requests)
    run_point(loaded, prompts[:2], 2, 2, 256)  # warm-up
    seq_points = [run_point(loaded, prompts, max_tokens, s, max(budgets)) for s in seqs]
    knee = find_knee(seq_points)
    at = knee.max_num_seqs if knee is not None else max(seqs)
    token_points = [run_point(loaded, prompts, max_tokens, at, b) for b in budgets]
    table = Table(title=f"sweep: {loaded.name}, {requests} requests x {max_tokens} tokens, {n_threads} threads")
    columns = ("max_num_seqs", "max_batched_tokens", "steps", "tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms")
    for col in (*columns, "e2e p50/p99 s"):
        table.add_column(col)
    for p in seq_points + token_points:
        table.add_row(
            f"{p.max_num_seqs}" + (" (knee)" if p is knee else ""),
            str(p.max_num_batched_tokens),
            str(p.steps),
            f"{p.throughput:.1f}",
            f"{1e3 * p.ttft_p50:.0f} / {1e3 * p.ttft_p99:.0f}",
            f"{1e3 * p.tpot_p50:.1f} / {1e3 * p.tpot_p99:.1f}",
            f"{p.e2e_p50:.2f} / {p.e2e_p99:.2f}",
        )
    console.print(table)
    if knee is None:
        console.print(f"no knee: throughput still grows by 10% or more at max_num_seqs={max(seqs)}")
    else:
        console.print(
            f"knee at max_num_seqs={knee.max_num_seqs}: beyond it throughput grows by less than 10% "
            "while the per-token latency climbs"
        )
    plot_sweep(seq_points, token_points, knee, f"kvlab bench sweep: {loaded.name}, {requests} requests", plot)
    console.print(f"wrote {plot}")
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
    from rich.table import Table

    from kvlab.bench.layout import compare_layouts

    batch_list, context_list = int_list(batches), int_list(contexts)
    loaded = load_or_exit(model)
    cfg = loaded.config
    n_threads = set_threads(threads, loaded)
    rows = compare_layouts(
        batch_list, context_list, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads, min_run_time=min_run_time
    )
    table = Table(
        title=f"layout: {cfg.num_kv_heads} KV heads x {cfg.head_dim}, {cfg.num_heads} query heads, one layer, "
        f"{n_threads} threads"
    )
    for col in ("op", "batch", "context", "NHD µs", "HND µs", "HND / NHD"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.op, str(r.batch), str(r.context), f"{r.nhd_us:.1f}", f"{r.hnd_us:.1f}", f"{r.hnd_over_nhd:.2f}")
    console.print(table)
    dump_json(json_out, [r.as_dict() for r in rows])


@bench_app.command("memory")
def bench_memory(
    preset: Annotated[str, typer.Option(help="KV shape preset for the byte figures")] = "smollm2-135m",
    dtype: Annotated[str, typer.Option(help="KV element type for the byte figures")] = "fp16",
    sequences: Annotated[int, typer.Option(min=1, help="Sequences in the mixed-length workload")] = 64,
    max_seq_len: Annotated[int, typer.Option(min=32, help="What a contiguous cache reserves per sequence")] = 2048,
    block_size: Annotated[int, typer.Option(min=1)] = CacheConfig.block_size,
    sharing: Annotated[str, typer.Option(help="N:P:S cases: N requests, P shared, S distinct tokens")] = (
        "16:100:20,64:100:20,8:1000:50,32:7:20"
    ),
    json_out: JsonOption = None,
) -> None:
    """Measured through the block manager: paged vs contiguous on mixed lengths; prefix-sharing savings."""
    from rich.table import Table

    from kvlab.bench.memory_use import measure_paging, measure_sharing, mixed_lengths
    from kvlab.memory import MemoryInputError, get_preset, human_bytes

    try:
        shape = get_preset(preset)
        cases = [tuple(int(x) for x in case.split(":")) for case in sharing.split(",")]
        if any(len(c) != 3 or min(c) < 1 for c in cases):
            raise ValueError(sharing)
    except MemoryInputError as exc:
        raise typer.BadParameter(str(exc), param_hint="--preset") from exc
    except ValueError as exc:
        raise typer.BadParameter(f"expected N:P:S triples of positive integers, got {sharing!r}") from exc
    paging = measure_paging(mixed_lengths(sequences, max_seq_len), block_size, max_seq_len, shape, dtype)
    t = Table(title=f"paged vs contiguous: {sequences} sequences of mixed length, {shape.name} {dtype}")
    for col in ("cache", "slots reserved", "bytes", "utilisation", "note"):
        t.add_column(col)
    t.add_row(
        "contiguous",
        str(paging.contiguous_slots),
        human_bytes(paging.contiguous_bytes),
        f"{paging.contiguous_utilisation:.1%}",
        f"max_seq_len={max_seq_len} per sequence",
    )
    t.add_row(
        "paged (measured)",
        str(paging.peak_blocks * block_size),
        human_bytes(paging.paged_bytes),
        f"{paging.paged_utilisation:.1%}",
        f"peak {paging.peak_blocks} blocks; calculator predicts {paging.predicted_blocks}",
    )
    console.print(t)
    console.print(
        f"{paging.used_tokens} tokens held; the paged pool needs "
        f"{paging.contiguous_bytes / paging.paged_bytes:.2f}x less memory than contiguous preallocation"
    )
    s = Table(title=f"prefix sharing (block size {block_size}), measured with share_prefix off and on")
    for col in ("N", "P", "S", "blocks unshared", "blocks shared", "saved blocks", "predicted", "saved tokens"):
        s.add_column(col)
    s.add_column("ideal")
    shares = [measure_sharing(n, p, suffix, block_size) for n, p, suffix in cases]
    for m in shares:
        s.add_row(
            *map(str, (m.requests, m.prefix_len, m.suffix_len, m.blocks_unshared, m.blocks_shared, m.saved_blocks)),
            str(m.predicted_saved_blocks),
            str(m.saved_tokens),
            f"{m.ideal_saved_tokens} = (N-1) x P",
        )
    console.print(s)
    console.print("saved tokens fall short of (N-1) x P by the partial last block of the prefix: it is copied on write")
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
    import torch
    from rich.table import Table

    from kvlab.bench.modes import ModelsByDtype
    from kvlab.bench.step import decode_step_timings, matmul_roofline, memory_bandwidth, profile_decode

    mode_list = _modes_of(model, modes)
    batch_list = int_list(batches)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    model_in = ModelsByDtype(model, {"float32": loaded})
    peaks = {m.dtype: matmul_roofline(dtype=getattr(torch, m.dtype)) for m in mode_list}
    bandwidth = memory_bandwidth()
    rows = [t for b in batch_list for t in decode_step_timings(model_in, mode_list, b, context, steps)]
    peak_text = ", ".join(f"{d} {g:.1f} GFLOP/s" for d, g in peaks.items())
    table = Table(
        title=f"decode step: {loaded.name}, {n_threads} threads; matmul peak (2048^3) {peak_text}; "
        f"memory {bandwidth:.1f} GB/s"
    )
    columns = ("mode", "batch", "step ms", "prepare ms", "forward ms", "step / forward", "GFLOP/s", "weights MB")
    for col in (*columns, "roofline ms", "step / roofline"):
        table.add_column(col)
    mode_of = {m.name: m for m in mode_list}
    out = []
    for r in rows:
        floor = r.roofline_ms(peaks[mode_of[r.mode].dtype], bandwidth)
        table.add_row(
            r.mode,
            str(r.batch),
            f"{r.step_ms:.2f}",
            f"{r.prepare_ms:.2f}",
            f"{r.forward_ms:.2f}",
            f"{r.step_over_forward:.2f}x",
            f"{r.gflops:.1f}",
            f"{r.weight_bytes / 1e6:.0f}",
            f"{floor:.1f}",
            f"{r.step_ms / floor:.2f}x",
        )
        out.append(r.as_dict() | {"roofline_ms": floor, "step_over_roofline": r.step_ms / floor})
    console.print(table)
    console.print(
        "roofline ms: max(step FLOPs / the dtype's matmul peak, weight bytes / memory bandwidth); at small batches "
        "the step is bound by streaming the weights, at large ones by arithmetic"
    )
    if profile is not None:
        console.print(profile_decode(model_in(mode_list[0].dtype), profile, context, mode=mode_list[0]))
    dump_json(json_out, {"matmul_peak_gflops": peaks, "memory_gbps": bandwidth, "steps": out})


def _check_cow_workloads(text: str) -> str:
    from kvlab.bench.cow import WORKLOADS

    _names(text, WORKLOADS, "workloads")
    return text


@bench_app.command("cow")
def bench_cow(
    model: ModelOption = "mini",
    workloads: Annotated[
        str, typer.Option(callback=_check_cow_workloads, help="Comma-separated: passphrase, fork, chat")
    ] = "passphrase,fork,chat",
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
    from rich.table import Table

    from kvlab.bench.cow import WORKLOADS, CowSizes, compare_cow_checks
    from kvlab.config import ConfigError

    try:
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    names = _names(workloads, WORKLOADS, "workloads")
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    sizes = CowSizes(trials=trials, requests=requests, n=n, sessions=sessions, turns=turns, max_tokens=max_tokens)
    rows = compare_cow_checks(loaded, names, sizes, cache, repeats=repeats)
    table = Table(
        title=f"cow: {loaded.name}, blocks of {block_size} tokens ({rows[0].write.block_nbytes / 1024:g} KiB each), "
        f"{num_blocks} blocks, {n_threads} threads, best of {repeats}"
    )
    columns = ("workload", "cow_check", "seqs", "steps", "copies", "at alloc", "not needed", "extra vs write")
    for col in (*columns, "MiB copied", "KV µs/step", "copy µs/step", "total s", "identical"):
        table.add_column(col)
    for row in rows:
        for run in (row.write, row.allocate):
            table.add_row(
                row.workload,
                run.cow_check,
                str(run.sequences),
                str(run.steps),
                str(run.cow_copies),
                str(run.cow_copies_eager),
                str(run.cow_copies_unneeded),
                "-" if run is row.write else f"{row.extra_copies:+d}",
                f"{run.cow_bytes / 2**20:.2f}",
                f"{run.kv_us_per_step:.1f}",
                f"{run.copy_us_per_step:.1f}",
                f"{run.total_seconds:.2f}",
                "yes" if row.identical else "[red]NO[/red]",
            )
    console.print(table)
    console.print(
        "at alloc: copies made at admission/fork (cow_check=allocate); not needed: of those, copies the request was "
        "freed before writing into; extra vs write: copies beyond write's on the same workload (also counts copies "
        "written into after their source was released, which write would have written in place)"
    )
    dump_json(json_out, [row.as_dict() for row in rows])
    bad = [row for row in rows if not row.identical]
    for row in bad:
        shown = ", ".join(row.mismatches[:5]) + (" ..." if len(row.mismatches) > 5 else "")
        console.print(
            f"[red bold]MISMATCH[/red bold] {row.workload}: {len(row.mismatches)} request(s) got different tokens "
            f"under cow_check=write and allocate: {shown}"
        )
    if bad:
        raise typer.Exit(1)


def _check_prompt_format(text: str) -> str:
    if text.strip() not in ("token-ids", "text"):
        raise typer.BadParameter(f"expected token-ids or text, got {text!r}")
    return text.strip()


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
        str,
        typer.Option(
            callback=_check_prompt_format,
            help="token-ids: the prompts' token ids; text: their decoded text (servers refusing token lists)",
        ),
    ] = "token-ids",
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos/--no-ignore-eos", help="Send ignore_eos (off: servers refusing it)")
    ] = True,
    timeout: Annotated[float, typer.Option(min=0.001, help="Seconds each request may take in total")] = 600.0,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds per workload; the best wall time counts")] = 1,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="One unmeasured 2-prompt round first")] = True,
    api_key: Annotated[str | None, typer.Option(help="Sent as 'Authorization: Bearer KEY'")] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the results as JSON ('-': the JSON alone on stdout)")
    ] = None,
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
    from rich.console import Console

    from kvlab.bench.serve import ServeBenchError, serve_workload
    from kvlab.bench.serve import bench_serve as run_bench
    from kvlab.cli.bench_serve import METHOD_LINE, now, print_result
    from kvlab.cli.bench_serve import save_result as save

    to_stdout = json_out == Path("-")
    # With --json -, stdout carries the JSON alone: the tables go to stderr.
    out = Console(stderr=True, width=None if sys.stderr.isatty() else 140) if to_stdout else console
    loaded = load_or_exit(model)
    workloads = [serve_workload(loaded, n) for n in workload_sizes(requests, num_prompts)]
    date = now()
    try:
        bench = run_bench(
            base_url,
            workloads,
            max_tokens,
            served_model=served_model,
            prompt_format="text" if prompt_format == "text" else "token-ids",
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
        out.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        raise typer.Exit(2) from exc
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
    if to_stdout:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        dump_json(json_out, data)
    if bench.failed:
        raise typer.Exit(1)
