"""``kvlab probe``: black-box isolation check of any OpenAI-compatible server."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvlab.cli.common import dump_json

if TYPE_CHECKING:
    from kvlab.probe.probe import ProbeReport


def _render(report: ProbeReport) -> str:
    """The report as the few lines a terminal shows: counts, the first contaminated prompts, the verdict."""
    c = report.counts
    total = sum(c.values())
    lines = [
        f"probe of {report.base_url} ({report.model}): {report.rounds} rounds x {report.concurrency} concurrent "
        f"requests per group, {total} responses in {report.seconds:.1f}s",
        f"  same: {c.get('same', 0)}   diverged: {c.get('diverged', 0)}   contaminated: {c.get('contaminated', 0)}",
    ]
    if report.uninformative_groups:
        lines.append(f"  uninformative groups (all references equal): {', '.join(report.uninformative_groups)}")
    for o in [o for o in report.observations if o.outcome == "contaminated"][:5]:
        lines.append(
            f"  contaminated: group {o.group} prompt {o.prompt_index} (round {o.round}) follows prompt "
            f"{o.closest_other}'s reference for {o.other_prefix} tokens, its own for {o.own_prefix}"
        )
    lines.append(
        "  verdict: "
        + ("LEAK: responses carry other prompts' state" if report.contaminated else "no contamination seen")
    )
    return "\n".join(lines)


def _passphrase_probe(
    base_url: str,
    model: str,
    passphrases: str | None,
    probe_kw: dict[str, Any],
    timing_kw: dict[str, Any] | None,
    json_out: Path | None,
) -> None:
    """The burst probe (and ``--timing``); exit 1 when a response is contaminated, 2 when the probe fails."""
    from kvlab.experiment.passphrases import PassphraseFileError, default_passphrases, load_passphrases
    from kvlab.probe.probe import ProbeError, run_probe
    from kvlab.probe.timing import run_timing

    try:
        pset = load_passphrases(passphrases) if passphrases else default_passphrases()
    except PassphraseFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        report = run_probe(base_url, model, pset, **probe_kw)
        timed = run_timing(base_url, model, **timing_kw) if timing_kw is not None else None
    except ProbeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    data = report.to_json()
    if timed is not None:
        data["timing"] = {**asdict(timed), "auc_unsalted": timed.unsalted.auc, "auc_salted": timed.salted.auc}
    if json_out != STDOUT:
        typer.echo(_render(report))
        if timed is not None:
            typer.echo(timed.render())
    _write_json(json_out, data)
    if report.contaminated:
        raise typer.Exit(1)


def _extract(
    base_url: str, model: str, json_out: Path | None, api_key: str | None, victim_api_key: str | None, **kw: Any
) -> None:
    """``--extract``: run the prompt-extraction attack; exit 1 on a leak, 2 when the probe cannot run."""
    from kvlab.probe.extract import ExtractConfig, exit_code, render, run_extract
    from kvlab.probe.probe import ProbeError

    try:
        cfg = ExtractConfig(**kw)
        cfg.validate()
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        report = run_extract(base_url, model, cfg, api_key=api_key, victim_api_key=victim_api_key)
    except ProbeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if json_out != STDOUT:
        typer.echo(render(report))
    _write_json(json_out, report.to_json())
    raise typer.Exit(exit_code(report))


STDOUT = Path("-")


def _write_json(path: Path | None, data: dict[str, Any]) -> None:
    """``--json PATH`` as in every command; ``--json -`` prints the JSON alone, for pipes."""
    if path == STDOUT:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        dump_json(path, data)


def probe_cli(
    base_url: Annotated[str, typer.Option(help="Server root or its /v1 URL, e.g. http://127.0.0.1:8000/v1")],
    model: Annotated[str | None, typer.Option(help="Model name (default: the first id of /v1/models)")] = None,
    passphrases: Annotated[str | None, typer.Option(help="YAML/JSON passphrase file (default: built-in)")] = None,
    concurrency: Annotated[int, typer.Option(min=1, max=256, help="Concurrent requests per burst")] = 8,
    rounds: Annotated[int, typer.Option(min=1, help="Bursts per passphrase group")] = 3,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per response")] = 16,
    seed: Annotated[
        int | None,
        typer.Option(help="Seed of burst order and arrival offsets (default 0); with --extract, of the secret"),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the full report as JSON here ('-': print only the JSON)")
    ] = None,
    timing: Annotated[
        bool, typer.Option(help="Also measure TTFT of prefix hits vs misses, with and without salts")
    ] = False,
    timing_trials: Annotated[int, typer.Option(min=1, help="Hit/miss pairs per timing run")] = 20,
    timing_prefix_chars: Annotated[int, typer.Option(min=1, help="Length of the timing prompts' prefixes")] = 400,
    api_key: Annotated[str | None, typer.Option(help="API key of the probe (the attacker with --extract)")] = None,
    extract: Annotated[
        bool,
        typer.Option(
            help="Run the prompt-extraction attack instead: recover a simulated victim's secret via the cache"
        ),
    ] = False,
    victim_api_key: Annotated[str | None, typer.Option(help="--extract: the simulated victim's API key")] = None,
    secret: Annotated[str | None, typer.Option(help="--extract: the victim's secret (default: random)")] = None,
    secret_length: Annotated[
        int | None, typer.Option(min=1, help="--extract: length of the random secret (default 8 to 12)")
    ] = None,
    alphabet: Annotated[str, typer.Option(help="--extract: characters of the secret, known to the attacker")] = (
        "abcdefghijklmnop"
    ),
    prefix: Annotated[
        str | None, typer.Option(help="--extract: the victim's known prefix (default: fresh, laid out for the attack)")
    ] = None,
    max_candidates: Annotated[
        int, typer.Option(min=1, help="--extract: most guesses per step (a step guesses up to a block boundary)")
    ] = 256,
    ttft_repeats: Annotated[int, typer.Option(min=2, help="--extract: TTFT samples per candidate")] = 5,
) -> None:
    """Black-box isolation check: do concurrent requests to an OpenAI-compatible server leak into each other?
    Exits 1 when a response is contaminated (or, with --extract, when the secret leaks); 2 when the probe fails."""
    from kvlab.probe.probe import ProbeError, discover_model, normalize_base_url

    base_url = normalize_base_url(base_url)
    if model is None:
        try:
            model = discover_model(base_url, api_key)
        except ProbeError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
    if extract:
        n = (secret_length, secret_length) if secret_length else (8, 12)
        _extract(
            base_url,
            model,
            json_out,
            api_key,
            victim_api_key,
            alphabet=alphabet,
            secret=secret,
            secret_length=n,
            prefix=prefix,
            max_candidates=max_candidates,
            ttft_repeats=ttft_repeats,
            seed=seed,
        )
    _passphrase_probe(
        base_url,
        model,
        passphrases,
        dict(concurrency=concurrency, rounds=rounds, max_tokens=max_tokens, seed=seed or 0, api_key=api_key),
        dict(trials=timing_trials, prefix_chars=timing_prefix_chars, seed=seed or 0, api_key=api_key)
        if timing
        else None,
        json_out,
    )
