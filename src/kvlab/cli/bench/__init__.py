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
from kvlab.cli.bench.speculative import bench_speculative
from kvlab.cli.bench.step import bench_step
from kvlab.cli.bench.sweep import bench_sweep
from kvlab.cli.bench.tenants import bench_tenants
from kvlab.cli.bench.throughput import bench_throughput
from kvlab.cli.commands import BenchCommand, KvlabGroup

bench_app = typer.Typer(cls=KvlabGroup, no_args_is_help=True, help="Benchmarks against peers measured in the same run.")
# In the order kvlab bench --help lists them; each runs inside a progress display on a terminal (BenchCommand).
bench_app.command("throughput", cls=BenchCommand)(bench_throughput)
bench_app.command("fidelity", cls=BenchCommand)(bench_fidelity)
bench_app.command("sweep", cls=BenchCommand)(bench_sweep)
bench_app.command("layout", cls=BenchCommand)(bench_layout)
bench_app.command("memory", cls=BenchCommand)(bench_memory)
bench_app.command("step", cls=BenchCommand)(bench_step)
bench_app.command("cow", cls=BenchCommand)(bench_cow)
bench_app.command("serve", cls=BenchCommand)(bench_serve)
bench_app.command("manager", cls=BenchCommand)(bench_manager)
bench_app.command("tenants", cls=BenchCommand)(bench_tenants)
bench_app.command("scaling", cls=BenchCommand)(bench_scaling)
bench_app.command("speculative", cls=BenchCommand)(bench_speculative)

__all__ = ["bench_app"]
