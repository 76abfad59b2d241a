"""``kvlab bench memory``: paging and sharing measured against the memory calculator.
Heavy imports wait until it runs."""

from __future__ import annotations

from typing import Annotated

import typer

from kvlab.cli.common import (
    JsonOption,
    dump_json,
    list_callback,
    out_console,
    parsed_list,
    render,
)
from kvlab.cli.progress import phase
from kvlab.config import CacheConfig


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
            metavar="N:P:S,...",
            help="Comma-separated N:P:S cases: N requests, P shared, S distinct tokens",
        ),
    ] = "16:100:20,64:100:20,8:1000:50,32:7:20",
    json_out: JsonOption = None,
) -> None:
    """Measured through the block manager: paged vs contiguous on mixed lengths; prefix-sharing savings."""
    from kvlab.bench.studies.memory_use import (
        measure_paging,
        measure_sharing,
        mixed_lengths,
        paging_table,
        sharing_table,
    )
    from kvlab.memory import MemoryInputError, get_preset

    out = out_console(json_out)
    try:
        shape = get_preset(preset)
    except MemoryInputError as exc:
        raise typer.BadParameter(str(exc), param_hint="--preset") from exc
    phase("paging")
    paging = measure_paging(mixed_lengths(sequences, max_seq_len), block_size, max_seq_len, shape, dtype)
    render(out, paging_table(paging, shape.name, dtype))
    phase("sharing")
    shares = [measure_sharing(n, p, suffix, block_size) for n, p, suffix in sharing_cases(sharing)]
    render(out, sharing_table(shares, block_size))
    dump_json(json_out, {"paging": paging.as_dict(), "sharing": [m.as_dict() for m in shares]})
