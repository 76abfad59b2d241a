"""``kvlab bench fidelity``: the reduced-precision modes' tokens and logits against fp32.
Heavy imports wait until it runs."""

from __future__ import annotations

from typing import Annotated, get_args

import typer

from kvlab.cli.common import (
    DtypeName,
    JsonOption,
    ModelOption,
    ThreadsOption,
    check_extra,
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
from kvlab.config import KV_CACHE_DTYPES, QUANTIZATION_MODES

QUANTIZATIONS = ("none", *QUANTIZATION_MODES)  # "none": ModeConfig.quantization=None, the model's own weights
MODEL_DTYPES = tuple(d for d in get_args(DtypeName) if d != "auto")  # what a model is loaded in


def bench_fidelity(
    model: ModelOption = "mini",
    dtype: Annotated[str, names_option(MODEL_DTYPES, "dtypes", "Comma-separated model dtypes")] = "float32",
    quantization: Annotated[
        str,
        names_option(
            QUANTIZATIONS,
            "quantization modes",
            "Comma-separated quantisations (weight-only with bf16 activations; gguf: the file's Q4_1; int8-w8a8: int8 "
            "weights and activations; int8-w8a8-head: the LM head too; none: the weights as they are)",
        ),
    ] = "none,int8,int4,gguf,int8-w8a8,int8-w8a8-head",
    kv_cache_dtype: Annotated[
        str,
        names_option(
            KV_CACHE_DTYPES,
            "KV cache dtypes",
            "Comma-separated KV cache dtypes (auto: the model's; fp8 = fp8_e4m3, unscaled as vLLM's default)",
        ),
    ] = "auto",
    num_prompts: Annotated[int, typer.Option(min=1, help="W<N>: the throughput benchmark's prompts")] = 16,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    hf: Annotated[bool, typer.Option("--hf/--no-hf", help="Also compare gguf modes with transformers")] = True,
    threads: ThreadsOption = None,
    json_out: JsonOption = None,
) -> None:
    """Each mode (dtype x quantization x KV cache dtype) against fp32 on the W<N> prompts: requests whose greedy
    tokens are all identical, first-divergence p50, max |logit difference| over every prompt position; gguf modes
    also against HF transformers' dequantised model of the same file."""
    from kvlab.bench.peers.plan import gguf_of
    from kvlab.bench.studies.fidelity import Mode, fidelity_table, measure_fidelity
    from kvlab.config import ConfigError

    out = out_console(json_out)
    dtypes = name_list(dtype, MODEL_DTYPES, "dtypes")
    quants = name_list(quantization, QUANTIZATIONS, "quantization modes")
    kvs = name_list(kv_cache_dtype, KV_CACHE_DTYPES, "KV cache dtypes")
    if "gguf" in quants and gguf_of(model) is None:
        out.print(f"[yellow]gguf skipped:[/yellow] {model!r} is not a GGUF file (int8 and int4 quantise any model)")
        quants.remove("gguf")
    if hf and "gguf" in quants:  # the gguf modes are also compared with transformers' model of the file
        check_extra("models", "kvlab bench fidelity --hf")
    modes = [Mode(d, None if q == "none" else q, kv_cache_dtype=kv) for d in dtypes for q in quants for kv in kvs]
    reference = load_or_exit(model)
    n_threads = set_threads(threads, reference)
    phase(f"{len(modes)} modes against float32")
    try:
        rows = measure_fidelity(model, modes, num_prompts, max_tokens, against_hf=hf, reference=reference)
    except ConfigError as exc:
        fail(str(exc))
    render(out, fidelity_table(rows, model, num_prompts, max_tokens, n_threads))
    dump_json(json_out, [r.as_dict() for r in rows])
