"""The ``kvlab`` command."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import Console

from kvlab.memory import memory_cli

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="kvlab: shared state and isolation in the KV cache"
)
console = Console()

app.command("memory", help="KV cache size: MHA vs GQA vs MQA, paged vs contiguous, prefix sharing.")(
    memory_cli
)


def _load(model: str):
    from kvlab.model import ModelLoadError, load_model

    try:
        return load_model(model)
    except (ModelLoadError, ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text")],
    model: Annotated[str, typer.Option(help="mini | mini-gqa | mini-mqa | smollm2 | PATH")] = "mini",
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate (greedy)")] = 32,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template")] = False,
    dense: Annotated[
        bool, typer.Option(help="Use the dense no-cache reference instead of the engine")
    ] = False,
) -> None:
    """Print the greedy continuation of PROMPT."""
    from kvlab import LLM, SamplingParams
    from kvlab.model import dense_generate

    loaded = _load(model)
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = loaded.tokenizer.encode(text)
    if not ids:
        console.print("[red]error:[/red] the prompt is empty")
        raise typer.Exit(2)
    t0 = time.perf_counter()
    if dense:
        out = dense_generate(loaded.model, ids, max_tokens, stop_token_ids=[loaded.tokenizer.eos_token_id])
    else:
        llm = LLM(loaded)
        res = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        if res.error:
            console.print(f"[red]error:[/red] {res.error}")
            raise typer.Exit(2)
        out = res.token_ids
    dt = time.perf_counter() - t0
    typer.echo(loaded.tokenizer.decode(out))
    console.print(
        f"[dim]{len(out)} tokens in {dt:.2f}s ({len(out) / dt:.1f} tok/s, {model})[/dim]", highlight=False
    )


def main() -> None:  # pragma: no cover
    app()
