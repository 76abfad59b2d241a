"""``kvlab bench tenants``: one multi-tenant workload under five sharing policies (``kvlab.bench.studies.tenants``).
The benchmark is imported when the command runs, so ``kvlab --help`` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.bench.names import TENANT_POLICIES
from kvlab.cli.common import (
    JsonOption,
    ModelOption,
    ThreadsOption,
    dump_json,
    fail,
    int_pair,
    int_range_option,
    load_or_exit,
    name_list,
    names_option,
    out_console,
    render,
    set_threads,
)
from kvlab.cli.progress import phase


def bench_tenants(
    model: ModelOption = "mini",
    tenants: Annotated[int, typer.Option(min=2, help="Tenants, each with its own document")] = 16,
    requests_per_tenant: Annotated[int, typer.Option(min=1, help="Requests each tenant sends")] = 6,
    declared: Annotated[int, typer.Option(min=0, help="System prompts the operator declared public")] = 2,
    undeclared: Annotated[int, typer.Option(min=0, help="System prompts as popular, not declared")] = 1,
    system_tokens: Annotated[
        str, int_range_option("System prompt length range (cut to what the model holds)")
    ] = "200,2000",
    document_tokens: Annotated[str, int_range_option("Each tenant's document, length range")] = "64,128",
    question_tokens: Annotated[str, int_range_option("Each request's question, length range")] = "8,32",
    max_tokens: Annotated[int, typer.Option(min=1, help="Greedy tokens per request (EOS ignored)")] = 16,
    rate: Annotated[float, typer.Option(min=0.001, help="Requests arriving per engine step (Poisson)")] = 0.5,
    promote_after: Annotated[int, typer.Option(min=2, help="K of the public+promotion policy")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the texts and arrivals")] = 0,
    policies: Annotated[str, names_option(TENANT_POLICIES, "policies")] = ",".join(TENANT_POLICIES),
    num_blocks: Annotated[
        int | None, typer.Option(min=2, help="KV pool (default: every prompt once over, so nothing is evicted)")
    ] = None,
    block_size: Annotated[int, typer.Option(min=1, max=1024)] = 16,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 32,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens one step computes: a long prompt takes several steps")
    ] = 256,
    repeats: Annotated[int, typer.Option(min=1, help="Runs per policy; the fastest counts")] = 1,
    flood: Annotated[
        bool,
        typer.Option(
            "--flood",
            help="Instead: the shared pool between tenants. A victim's cache beside a flooding tenant under lru "
            "and fair eviction, and a watcher's AUC of 'the victim was active' from its own cache hits",
        ),
    ] = False,
    threads: ThreadsOption = None,
    json_out: JsonOption = None,
) -> None:
    """T tenants sharing a few system prompts (some declared public), each with its own document and questions,
    arriving over time, under off, per-tenant, public-prefixes, public+promotion and global sharing: hit
    tokens, TTFT p50/p99, throughput, KV blocks, promotions, and how much of global's gain each policy keeps.
    Every policy's greedy tokens must equal off's (exit 1 otherwise). With --flood: the pool fairness study
    (kvlab.bench.studies.tenant_flood); the victim's tokens must equal its tokens alone (exit 1 otherwise)."""
    from kvlab.bench.studies.tenants import TenantWorkload, tenants_table
    from kvlab.bench.studies.tenants import bench_tenants as run
    from kvlab.config import ConfigError

    if flood:
        _flood(model, seed, threads, json_out)
        return
    out = out_console(json_out)
    chosen = name_list(policies, TENANT_POLICIES, "policies", flag="--policies")
    try:
        w = TenantWorkload(
            tenants=tenants,
            requests_per_tenant=requests_per_tenant,
            declared=declared,
            undeclared=undeclared,
            system_tokens=int_pair(system_tokens),
            document_tokens=int_pair(document_tokens),
            question_tokens=int_pair(question_tokens),
            max_tokens=max_tokens,
            rate=rate,
            promote_after=promote_after,
            seed=seed,
        )
    except ConfigError as exc:
        fail(str(exc))
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    phase(f"policies {', '.join(chosen)}")
    try:
        bench = run(loaded, w, chosen, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, repeats)
    except ConfigError as exc:
        fail(str(exc))
    render(out, tenants_table(bench, loaded.name, n_threads))
    dump_json(json_out, bench.as_dict())
    differ = [r.policy for r in bench.runs if r.differing_outputs]
    if differ:
        fail(f"greedy tokens differ from off's under {', '.join(differ)}: sharing changed an output", code=1)


def _flood(model: str, seed: int, threads: int | None, json_out: Path | None) -> None:
    from kvlab.bench.studies.tenant_flood import FloodWorkload, bench_flood, flood_table
    from kvlab.config import ConfigError

    out = out_console(json_out)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    try:
        bench = bench_flood(loaded, FloodWorkload(seed=seed))
    except ConfigError as exc:
        fail(str(exc))
    render(out, flood_table(bench, loaded.name, n_threads))
    dump_json(json_out, bench.as_dict())
    if bench.differing():
        fail(f"the victim's greedy tokens differ from its tokens alone under {', '.join(bench.differing())}", code=1)
