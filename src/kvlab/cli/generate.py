"""``kvlab generate``: the greedy continuation of one prompt."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from kvlab.cli.common import (
    AttentionBackendOption,
    DtypeOption,
    KvCacheDtypeOption,
    ModelOption,
    QuantizationOption,
    check_engine_mode,
    console,
    fail,
    load_or_exit,
    set_threads,
)


def generate_cli(
    prompt: Annotated[str, typer.Argument(help="Prompt text")],
    model: ModelOption = "mini",
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = None,
    attention_backend: AttentionBackendOption = "reference",
    kv_cache_dtype: KvCacheDtypeOption = "auto",
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate (greedy)")] = 32,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template")] = False,
    dense: Annotated[
        bool, typer.Option("--dense", help="Use the dense no-cache reference instead of the engine")
    ] = False,
) -> None:
    """Print the greedy continuation of PROMPT."""
    from kvlab import LLM, ConfigError, SamplingParams
    from kvlab.engine.sizing import storage_dtype
    from kvlab.model import dense_generate

    check_engine_mode(quantization, attention_backend)
    loaded = load_or_exit(model, dtype=dtype)
    set_threads(None, loaded)
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = loaded.tokenizer.encode(text)
    if not ids:
        fail("the prompt is empty")
    t0 = time.perf_counter()
    out: list[int]
    if dense:
        eos = loaded.tokenizer.eos_token_id
        stops = [] if eos is None else [eos]
        kv_dtype = storage_dtype(kv_cache_dtype, loaded.model.dtype)  # the oracle rounds K/V as that cache holds them
        dense_out = dense_generate(loaded.model, ids, max_tokens, stop_token_ids=stops, kv_dtype=kv_dtype)
        assert isinstance(dense_out, list)  # a list of ids, not (ids, logits), without return_logits
        out = dense_out
    else:
        try:
            llm = LLM(
                loaded, quantization=quantization, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype
            )
        except ConfigError as exc:  # e.g. gguf on a model that is not a GGUF file
            fail(str(exc))
        res = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        if res.error:
            fail(res.error)
        out = res.token_ids
    dt = time.perf_counter() - t0
    typer.echo(loaded.tokenizer.decode(out))
    console.print(f"[dim]{len(out)} tokens in {dt:.2f}s ({len(out) / dt:.1f} tok/s, {model})[/dim]", highlight=False)
