"""``kvlab divergence``: how often an unsafe cache pollutes two prompts, by where they part inside a block."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import (
    JsonOption,
    ModelOption,
    ThreadsOption,
    dump_json,
    load_or_exit,
    out_console,
    plot_option,
    set_threads,
    strategy_option,
)
from kvlab.experiment.strategies import BuiltinStrategy


def divergence_cli(
    model: ModelOption = "mini",
    strategy: Annotated[BuiltinStrategy, strategy_option("The strategy whose pollution is swept")] = "shared-no-cow",
    trials: Annotated[int, typer.Option(min=1, help="Trials per divergence offset")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the trial plans (arrivals, order, output lengths)")] = 0,
    block_size: Annotated[int, typer.Option(min=2, help="KV block size (the experiment's default)")] = 16,
    plot: Annotated[Path | None, plot_option("Also write the rates against the offset as a PNG here")] = None,
    json_path: JsonOption = None,
    threads: ThreadsOption = None,
) -> None:
    """Sweep where two prompts part relative to a block boundary (offset 0 .. block size - 1) and run the
    passphrase experiment's trials on each pair: with token-granular sharing and no copy-on-write, the second
    request's tokens land in the shared partial block, which exists only when the offset is not 0."""
    from rich.table import Table

    from kvlab.experiment.divergence import divergence_pairs, sweep
    from kvlab.experiment.harness import ExperimentConfig
    from kvlab.experiment.strategies import BUILTIN_STRATEGIES

    console = out_console(json_path)
    loaded = load_or_exit(model)
    set_threads(threads, loaded)
    cfg = ExperimentConfig(trials=trials, seed=seed, block_size=block_size)
    pairs = divergence_pairs(loaded.tokenizer.encode, block_size, cfg.max_model_len - cfg.max_tokens)
    with console.status(f"{len(pairs)} offsets x {trials} trials under {strategy}"):
        points = sweep(loaded, BUILTIN_STRATEGIES[strategy], pairs, cfg)
    table = Table(title=f"{loaded.name}, {strategy}, {trials} trials per offset, block {block_size}")
    for col in ("offset", "common tokens", "foreign read", "output changed", "took other's answer"):
        table.add_column(col, justify="right")
    for p in points:
        pct = [f"{100 * n / p.trials:.0f}%" for n in (p.foreign_read, p.output_changed, p.took_other)]
        table.add_row(str(p.offset), str(p.common_tokens), *pct)
    console.print(table)
    missing = sorted(set(range(block_size)) - {p.offset for p in points})
    if missing:
        console.print(f"no cut of the shared text parts at offsets {missing} with this tokenizer")
    payload = {"model": loaded.name, "strategy": strategy, "block_size": block_size, "trials": trials}
    dump_json(json_path, {**payload, "points": [asdict(p) for p in points]})
    if plot is not None:
        from kvlab.analysis.plots import divergence_figure, save_png

        save_png(divergence_figure(points, block_size, f"{loaded.name}: {strategy}, {trials} trials per offset"), plot)
        console.print(f"plot: {plot}", highlight=False)
