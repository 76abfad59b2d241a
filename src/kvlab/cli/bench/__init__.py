"""``kvlab bench``: every benchmark prints ratios against a peer measured in the same run; ``kvlab bench serve``
measures any OpenAI-compatible server from the client. One module per subcommand; the options several share
are in ``options`` (the kvlab modes) and ``kv_sweeps`` (the block-size and cliff studies of ``sweep``). Heavy
imports wait until a command runs, so ``kvlab --help`` stays fast."""

from __future__ import annotations

import typer

from kvlab.cli.bench.cow import bench_cow
from kvlab.cli.bench.fidelity import bench_fidelity
from kvlab.cli.bench.layout import bench_layout
from kvlab.cli.bench.manager import bench_manager
from kvlab.cli.bench.memory import bench_memory
from kvlab.cli.bench.scaling import bench_scaling
from kvlab.cli.bench.serve import bench_serve
from kvlab.cli.bench.step import bench_step
from kvlab.cli.bench.sweep import bench_sweep
from kvlab.cli.bench.tenants import bench_tenants
from kvlab.cli.bench.throughput import bench_throughput

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against peers measured in the same run.")
# In the order kvlab bench --help lists them.
bench_app.command("throughput")(bench_throughput)
bench_app.command("fidelity")(bench_fidelity)
bench_app.command("sweep")(bench_sweep)
bench_app.command("layout")(bench_layout)
bench_app.command("memory")(bench_memory)
bench_app.command("step")(bench_step)
bench_app.command("cow")(bench_cow)
bench_app.command("serve")(bench_serve)
bench_app.command("manager")(bench_manager)
bench_app.command("tenants")(bench_tenants)
bench_app.command("scaling")(bench_scaling)

__all__ = ["bench_app"]
