"""``kvlab bench throughput``: kvlab's modes against peers on the same weights, in the same run.
Heavy imports wait until it runs."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer
from rich.markup import escape

from kvlab.bench.names import THROUGHPUT_WORKLOADS
from kvlab.bench.peers.plan import HF_PEERS, PEERS, PeerPlan
from kvlab.cli.bench.options import ModesOption, modes_of
from kvlab.cli.common import (
    JsonOption,
    ModelOption,
    ThreadsOption,
    dump_json,
    extra_missing,
    fail,
    int_list,
    int_list_option,
    load_or_exit,
    name_list,
    names_option,
    out_console,
    render,
    set_threads,
)
from kvlab.cli.progress import phase
from kvlab.config import SchedulerConfig


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
    requests: Annotated[str, int_list_option("shared-prefix: comma-separated workload sizes N (W<N>)")] = "16,64",
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
    vllm_w8a8_model: Annotated[
        str | None,
        typer.Option(
            help="What --peers vllm-w8a8,vllm-w8a8-bf16 load: the same weights as W8A8 int8 codes in vLLM's format "
            "(smollm2: the one vllm.sh writes with scripts/peers/smollm2_w8a8_dir.py, kvlab's own codes)"
        ),
    ] = None,
    floor: Annotated[
        bool,
        typer.Option(
            "--floor/--no-floor",
            help="Measure this machine's matmul peaks and memory bandwidth first, and give each kvlab row its share "
            "of the floor of its own steps' work",
        ),
    ] = True,
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
    from kvlab.bench.peers.plan import PeerError, hf_peer_model, plan_peers
    from kvlab.bench.peers.vllm_peer import VLLMPeerError
    from kvlab.bench.studies.throughput import compare_throughput, throughput_table
    from kvlab.bench.workloads import WorkloadError, WorkloadSizes

    out = out_console(json_out)
    mode_list = modes_of(model, modes)
    try:
        plan = plan_peers(
            model, name_list(peers, PEERS, "peers", allow_empty=True), vllm_python, vllm_model, vllm_w8a8_model
        )
    except PeerError as exc:
        fail(str(exc))
    plan = _without_hf_peers_here(plan)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    for peer, why in plan.skipped:
        out.print(f"[yellow]{peer} skipped:[/yellow] {escape(why)}")  # a reason may hold brackets: kvlab[models]
    machine = None
    if floor:
        from kvlab.bench.studies.floor import Machine
        from kvlab.bench.studies.step import memory_bandwidth, mode_peaks

        phase("this machine's matmul peaks and memory bandwidth")
        machine = Machine(mode_peaks(mode_list), memory_bandwidth())
    phase(f"{', '.join(m.name for m in mode_list)}{', ' if plan.peers else ''}{', '.join(plan.peers)}")
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
            vllm_w8a8_model=plan.vllm_w8a8_model,
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
            machine=machine,
        )
    except VLLMPeerError as exc:
        fail(f"the vllm peer: {exc}", code=1)
    except WorkloadError as exc:
        fail(str(exc))
    render(out, throughput_table(rows, loaded.name, max_tokens, n_threads))
    dump_json(json_out, [row.as_dict() for row in rows])


def _without_hf_peers_here(plan: PeerPlan) -> PeerPlan:
    """``plan`` with the HF peers skipped, with their reason, where transformers is not installed (the base
    install), as ``plan_peers`` skips llama.cpp without llama-cpp-python: the kvlab modes still run."""
    why = extra_missing("models")
    if why is None or not plan.needs_hf:
        return plan
    hf = [p for p in plan.peers if p in HF_PEERS]
    return replace(
        plan,
        peers=tuple(p for p in plan.peers if p not in HF_PEERS),
        skipped=(*plan.skipped, *((p, why) for p in hf)),
    )
