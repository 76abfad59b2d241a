"""The ``--modes`` option of ``kvlab bench throughput``, ``step`` and ``scaling``: kvlab's modes parsed while the
command line is, and checked against the model before it loads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from kvlab.cli.common import fail, list_callback, parsed_list
from kvlab.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_MODES

if TYPE_CHECKING:
    from kvlab.bench.modes import Mode


def mode_list(text: str) -> list[Mode]:
    """The kvlab modes of a comma-separated list (``kvlab.bench.modes.parse_mode`` each), in order, without
    repeats; ``typer.BadParameter`` names the word it does not know or the clash."""
    from kvlab.bench.modes import parse_mode

    return parsed_list(text, parse_mode, "modes")  # parse_mode's ConfigError is a ValueError


def modes_of(model: str, text: str) -> list[Mode]:
    """The modes of ``text`` (checked when the command line was parsed), or exit 2 before any model loads when
    one cannot apply to ``model``."""
    from kvlab.bench.peers.plan import gguf_of

    modes = mode_list(text)
    if any(m.quantization == "gguf" for m in modes) and gguf_of(model) is None:
        fail(f"the gguf mode keeps a GGUF file's own codes; {model!r} is not a GGUF")
    return modes


# The words of a mode from the configs' choice lists (kvlab.bench.modes reads them from there too); the dtype
# words are fp32|float32, bf16|bfloat16 for the model and kv-fp32, kv-bf16 (or kv-float32, ...) for the cache, whose
# fp8 words are vLLM's names.
KV_WORDS = ("kv-fp32", "kv-bf16", *(f"kv-{d}" for d in KV_CACHE_DTYPES if d.startswith("fp8")))
ModesOption = Annotated[
    str,
    typer.Option(
        callback=list_callback(mode_list),
        help="Comma-separated kvlab modes, each '+'-joined words: fp32|bf16 (model dtype), "
        f"{'|'.join(QUANTIZATION_MODES)} (quantisation: of the weights; int8-w8a8 also of the activations), "
        f"{'|'.join(ATTENTION_BACKENDS[1:])} (compiled CPU kernels: in-place paged attention, fused norms/RoPE/SiLU, "
        f"small-batch linears), {'|'.join(KV_WORDS)} (KV cache dtype); e.g. fp32,fp32+cpp,bf16+cpp",
    ),
]
