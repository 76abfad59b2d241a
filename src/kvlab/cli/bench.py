"""``kvlab bench throughput|fidelity|sweep|layout|memory|step``: every benchmark prints ratios against a peer
measured in the same run. Heavy imports wait until a command runs, so ``kvlab --help`` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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
from kvlab.config import CacheConfig, SchedulerConfig

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against peers measured in the same run.")


@bench_app.command("throughput")
def bench_throughput(
    model: ModelOption = "mini",
    requests: Annotated[
        str, typer.Option(callback=check_int_list, help="Comma-separated workload sizes N (W<N>)")
    ] = "16,64",
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    threads: ThreadsOption = None,
    peers: Annotated[str, typer.Option(help="Comma-separated: hf-generate, hf-generate-batch, llama.cpp")] = (
        "hf-generate,hf-generate-batch,llama.cpp"
    ),
    repeats: Annotated[int, typer.Option(min=1, help="Runs per peer; the fastest counts")] = 1,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, help="Token budget per step (kvlab and HF CB)")
    ] = SchedulerConfig.max_num_batched_tokens,
    quantization: QuantizationOption = "none",
    json_out: JsonOption = None,
) -> None:
    """Shared-prefix throughput: N requests, one ~100-token system prompt, 32 greedy tokens each, EOS ignored."""
    from rich.table import Table

    from kvlab.bench.throughput import PEERS, compare_throughput, llama_cpp_available

    quant = _quantization_of(model, quantization)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    wanted = [p.strip() for p in peers.split(",") if p.strip()]
    if bad := sorted(set(wanted) - set(PEERS)):
        console.print(f"[red]error:[/red] unknown peer(s) {bad}; known: {', '.join(PEERS)}")
        raise typer.Exit(2)
    gguf = _gguf_of(model)
    if "llama.cpp" in wanted and not (llama_cpp_available() and gguf is not None):
        why = "llama-cpp-python is not installed" if not llama_cpp_available() else "the model is not a GGUF file"
        console.print(f"[yellow]llama.cpp skipped:[/yellow] {why} (kvlab never installs it)")
        wanted.remove("llama.cpp")
    hf_model = None
    if {"hf-generate", "hf-generate-batch"} & set(wanted):
        from kvlab.bench.peers import hf_from_gguf, hf_llama_from

        hf_model = hf_from_gguf(gguf) if gguf is not None else hf_llama_from(loaded.model)
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
        quantization=quant,
    )
    table = Table(title=f"throughput: {loaded.name}, {max_tokens} greedy tokens/request, {n_threads} threads")
    for col in ("workload", "peer", "seconds", "output tok/s", "kvlab speed-up", "identical", "common prefix", "setup"):
        table.add_column(col)
    for row in rows:
        r = row.result
        table.add_row(
            row.workload,
            r.name,
            f"{r.seconds:.2f}",
            f"{r.tokens_per_second:.1f}",
            f"{row.vs_kvlab:.2f}x",
            "-" if row.identical is None else f"{row.identical}/{len(r.tokens)}",
            "-" if row.common_prefix is None else f"{row.common_prefix:.1f}",
            r.setup,
        )
    console.print(table)
    dump_json(json_out, [row.as_dict() for row in rows])


def _gguf_of(model: str) -> Path | None:
    if model == "smollm2":
        from kvlab.model.gguf_loader import smollm2_gguf_path

        return smollm2_gguf_path()
    return Path(model) if model.endswith(".gguf") else None


QUANTIZATIONS = ("none", "int8", "int4", "gguf")


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated list of names from ``allowed``; ``typer.BadParameter`` names what is wrong."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or set(names) - set(allowed):
        raise typer.BadParameter(f"expected comma-separated {what} from {', '.join(allowed)}, got {text!r}")
    return list(dict.fromkeys(names))


def _check_quantizations(text: str) -> str:
    _names(text, QUANTIZATIONS, "quantization modes")
    return text


QuantizationOption = Annotated[
    str,
    typer.Option(
        callback=_check_quantizations,
        help="none | int8 | int4 | gguf (weight-only quantised linears, bf16 activations; gguf: the file's Q4_1)",
    ),
]


def _quantization_of(model: str, text: str) -> str | None:
    """The one mode of ``text``, or exit 2 before any model loads when it cannot apply to ``model``."""
    modes = _names(text, QUANTIZATIONS, "quantization modes")
    if len(modes) != 1:
        raise typer.BadParameter(f"one quantization mode here, got {text!r}", param_hint="--quantization")
    if modes[0] == "gguf" and not (model == "smollm2" or model.endswith(".gguf")):
        console.print(f"[red]error:[/red] --quantization gguf keeps a GGUF file's own codes; {model!r} is not a GGUF")
        raise typer.Exit(2)
    return None if modes[0] == "none" else modes[0]


@bench_app.command("fidelity")
def bench_fidelity(
    model: ModelOption = "mini",
    dtype: Annotated[str, typer.Option(help="Comma-separated model dtypes: float32, bfloat16")] = "float32",
    quantization: QuantizationOption = "none,int8,int4,gguf",
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
) -> None:
    """Throughput and p50/p99 latency over max_num_seqs, then over max_num_batched_tokens; finds the knee."""
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
    steps: Annotated[int, typer.Option(min=1, help="Timed decode steps (median)")] = 8,
    threads: ThreadsOption = None,
    profile: Annotated[int | None, typer.Option(help="Also print a torch.profiler table at this batch")] = None,
    json_out: JsonOption = None,
) -> None:
    """Decode step vs bare model forward, and the fraction of the fp32 matmul roofline reached."""
    from rich.table import Table

    from kvlab.bench.step import decode_step_timing, matmul_roofline, memory_bandwidth, profile_decode, weight_bytes

    batch_list = int_list(batches)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    roofline, bandwidth = matmul_roofline(), memory_bandwidth()
    wbytes = weight_bytes(loaded)
    rows = [decode_step_timing(loaded, b, context, steps) for b in batch_list]
    table = Table(
        title=f"decode step: {loaded.name}, {n_threads} threads; roofline {roofline:.1f} GFLOP/s (2048^3 matmul), "
        f"memory {bandwidth:.1f} GB/s"
    )
    for col in ("batch", "step ms", "prepare ms", "forward ms", "step / forward", "GFLOP/s", "% roofline"):
        table.add_column(col)
    table.add_column("weights GB/s")
    for r in rows:
        table.add_row(
            str(r.batch),
            f"{r.step_ms:.2f}",
            f"{r.prepare_ms:.2f}",
            f"{r.forward_ms:.2f}",
            f"{r.step_over_forward:.2f}x",
            f"{r.gflops:.1f}",
            f"{100 * r.gflops / roofline:.0f}%",
            f"{wbytes / r.step_ms / 1e6:.1f}",
        )
    console.print(table)
    console.print(
        "weights GB/s: the linear weights (read once per step whatever the batch) over the step time; "
        "at small batches the step is bound by this, not by arithmetic"
    )
    if profile is not None:
        console.print(profile_decode(loaded, profile, context))
    dump_json(
        json_out,
        {
            "roofline_gflops": roofline,
            "memory_gbps": bandwidth,
            "weight_bytes": wbytes,
            "steps": [r.as_dict() | {"roofline_fraction": r.gflops / roofline} for r in rows],
        },
    )
