"""``kvlab bench speculative``: prompt-lookup speculative decoding on the throughput benchmark's workloads.
Heavy imports wait until it runs."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvlab.bench.names import THROUGHPUT_WORKLOADS
from kvlab.cli.common import (
    JsonOption,
    ModelOption,
    SpeculativeOption,
    ThreadsOption,
    dump_json,
    fail,
    load_or_exit,
    name_list,
    names_option,
    out_console,
    render,
    set_threads,
)
from kvlab.cli.progress import phase
from kvlab.config import SpeculativeConfig


def bench_speculative(
    model: ModelOption = "mini",
    workloads: Annotated[
        str, names_option(THROUGHPUT_WORKLOADS, "workloads", "Comma-separated workloads, run in this order")
    ] = "shared-prefix,no-sharing,long-context,chat,parallel",
    num_prompts: Annotated[int, typer.Option(min=1, help="shared-prefix: W<N>'s prompts")] = 16,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    speculative_config: SpeculativeOption = None,
    peers: Annotated[
        str,
        names_option(
            ("vllm",),
            "peers",
            "Also run vLLM's CPU build (scripts/peers/vllm.sh) without and with it",
            allow_empty=True,
        ),
    ] = "",
    threads: ThreadsOption = None,
    json_out: JsonOption = None,
) -> None:
    """Each workload's greedy requests with and without speculation (default: ngram, 4 draft tokens, lookup
    1..4): drafts, draft tokens accepted (overall and by position), tokens identical to the plain run, steps and
    time. Time is measured, never asserted: run it on a quiet machine."""
    from kvlab.bench.studies.speculative import measure, speculative_table
    from kvlab.bench.workloads import build_workloads

    out = out_console(json_out)
    spec = speculative_config or SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=4)
    kinds = name_list(workloads, THROUGHPUT_WORKLOADS, "workloads")
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    built = build_workloads(loaded, kinds, [num_prompts], max_tokens)
    phase(f"{len(built)} workloads, each without and with speculation")
    rows, plain = measure(loaded, built, max_tokens, spec)
    peer = None
    if name_list(peers, ("vllm",), "peers", allow_empty=True):
        peer = _with_vllm(plain, loaded, model, built, max_tokens, spec, n_threads)
    render(out, speculative_table(rows, model, spec, n_threads, peer))
    dump_json(json_out, [r.as_dict() for r in [*rows, *(peer.rows if peer else [])]])


def _with_vllm(
    ours: list[Any],
    loaded: Any,
    model: str,
    built: list[Any],
    max_tokens: int,
    spec: SpeculativeConfig,
    threads: int,
) -> Any:
    """vLLM's run (``PeerRun``): the same workloads without and with the same speculative_config."""
    from kvlab.bench.peers.vllm_peer import VLLMPeer, VLLMPeerError, default_vllm_model, default_vllm_python
    from kvlab.bench.studies.speculative import measure_vllm
    from kvlab.bench.studies.throughput import vllm_knobs

    python, vllm_model = default_vllm_python(), default_vllm_model(model)
    if python is None or vllm_model is None:
        fail(f"no vLLM peer for {model!r}: scripts/peers/vllm.sh makes its venv and SmolLM2's fp32 directory")
    # What the vLLM engines are sized for, as in bench throughput: the longest prompt, as often as the most at once.
    peak = [max((p for w in built for p in w.prompts), key=len)] * max(len(w.peak()) for w in built)
    knobs = vllm_knobs(peak, max_tokens, loaded.config.max_position_embeddings, 2048)
    # vLLM's offline LLM turns its stats off; its spec_decode counters need them.
    knobs["disable_log_stats"] = False
    phase("vLLM without and with speculation (each engine compiles first)")
    try:
        with (
            VLLMPeer(python, vllm_model, knobs, threads=threads) as plain,
            VLLMPeer(python, vllm_model, knobs | {"speculative_config": spec.to_vllm()}, threads=threads) as drafted,
        ):
            return measure_vllm(plain, drafted, built, max_tokens, ours)
    except VLLMPeerError as exc:  # the engines could not start
        fail(str(exc))
