"""``kvlab probe``: black-box isolation check of any OpenAI-compatible server. Each phase shows as it runs (a
rich progress display like ``experiment``'s and ``fuzz``'s, on stderr when ``--json -`` makes stdout the
JSON's, gone when done on a terminal, its last state left in a log)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from kvlab.cli.common import (
    CommandError,
    check_output_paths,
    check_probability,
    dump_json,
    fail,
    input_file,
    out_console,
)

T = TypeVar("T")

if TYPE_CHECKING:
    from rich.console import Console

    from kvlab.probe.probe import ProbeConfig
    from kvlab.probe.progress import PhaseProgress, ProgressCallback
    from kvlab.probe.schema import Document

Reports = tuple[Path | None, Path | None]  # --sarif, --junit


@dataclass
class _Target:
    """The server and model a run is aimed at, as far as known (the model may be discovered on the way)."""

    base_url: str
    model: str | None


@contextmanager
def _error_reports(target: _Target, json_out: Path | None, reports: Reports, config: Path | None) -> Iterator[None]:
    """A run that ends in exit status 2 (it could not run, or was misused) still writes every report asked for:
    the error document (``kvlab.probe.schema.ErrorDocument``), SARIF with ``executionSuccessful: false``, JUnit
    with an ``<error>``."""
    from kvlab.probe.report import utc_now
    from kvlab.probe.schema import error_document

    started = utc_now()
    try:
        yield
    except CommandError as exc:
        if exc.exit_code == 2:
            doc = error_document(target.base_url, target.model, exc.message, started, sys.argv)
            _emit("", doc, json_out, reports, config)  # no text report: the error is printed as every error is
        raise


def _passphrase_probe(
    base_url: str,
    model: str,
    passphrases: Path | None,
    reuse_groups: Path | None,
    cfg: ProbeConfig,
    api_key: str | None,
    json_out: Path | None,
    reuse: bool = True,
    metrics_api_key: str | None = None,
    reports: Reports = (None, None),
    victim_api_key: str | None = None,
    config: Path | None = None,
) -> None:
    """The full probe; exit 1 on a leak, 3 on exposure only, 2 when the probe fails (see kvlab.probe.report);
    ``victim_api_key``: the timing victim's key (another tenant); ``config``: the file that configured it."""
    from kvlab.experiment.passphrases import PassphraseFileError, default_passphrases, load_passphrases
    from kvlab.probe.material import ReuseFileError, load_reuse_groups
    from kvlab.probe.probe import plan_requests, render, run_probe
    from kvlab.probe.schema import probe_document

    try:
        pset = load_passphrases(passphrases) if passphrases is not None else default_passphrases()
        # None: the built-in reuse groups; []: none (--no-reuse).
        groups = None if reuse_groups is None else load_reuse_groups(reuse_groups)
        groups = groups if reuse else []
        cfg.validate()
    except (PassphraseFileError, ReuseFileError, ValueError) as exc:
        fail(str(exc))
    plan = plan_requests(cfg, pset, groups)
    phases = ", ".join(f"{phase} {n}" for phase, n in plan.items())
    skipped = "" if cfg.timing else "; --no-timing: no timing runs"
    bound = (
        "no time bound (--max-seconds 0)"
        if cfg.max_seconds is None
        else f"about {cfg.max_seconds:g} s: a slow server gets fewer of them (--max-seconds)"
    )
    out_console(json_out).print(
        f"probe plan: at most {sum(plan.values())} requests ({phases}; retries not counted){skipped}; {bound}",
        highlight=False,
    )
    report = _or_exit(
        lambda progress: run_probe(
            base_url,
            model,
            pset,
            cfg,
            api_key=api_key,
            metrics_api_key=metrics_api_key,
            victim_api_key=victim_api_key,
            reuse_groups=groups,
            progress=progress,
        ),
        json_out,
    )
    _emit(render(report), probe_document(report, sys.argv), json_out, reports, config)
    raise typer.Exit(report.exit_code)


def _extract(
    base_url: str,
    model: str,
    json_out: Path | None,
    api_key: str | None,
    victim_api_key: str | None,
    metrics_api_key: str | None,
    timeout: float = 60.0,
    reports: Reports = (None, None),
    config: Path | None = None,
    **kw: Any,
) -> None:
    """``--extract``: run the prompt-extraction attack; exit 1 on a leak, 2 when the probe cannot run."""
    from kvlab.probe.attacks.base import ExtractConfig
    from kvlab.probe.extract import exit_code, render, run_extract
    from kvlab.probe.schema import extract_document

    try:
        cfg = ExtractConfig(**kw)
        cfg.validate()
    except ValueError as exc:
        fail(str(exc))
    report = _or_exit(
        lambda progress: run_extract(
            base_url,
            model,
            cfg,
            api_key=api_key,
            victim_api_key=victim_api_key,
            metrics_api_key=metrics_api_key,
            timeout=timeout,
            progress=progress,
        ),
        json_out,
    )
    _emit(render(report), extract_document(report, sys.argv), json_out, reports, config)
    raise typer.Exit(exit_code(report))


def _lines(path: Path | None) -> tuple[str, ...] | None:
    """A --dictionary or --candidates file: its non-blank lines (line ends stripped, nothing else)."""
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read {path}: {exc}")
    return tuple(line.rstrip("\r") for line in text.split("\n") if line.strip())


def _or_exit(run: Callable[[ProgressCallback], T], json_out: Path | None) -> T:
    """The probe's result, its phases shown while it runs; or its error on stderr and exit status 2 (it could
    not run)."""
    from kvlab.probe.probe import ProbeError

    try:
        with phase_display(out_console(json_out)) as progress:
            return run(progress)
    except ProbeError as exc:
        fail(str(exc))


@contextmanager
def phase_display(console: Console) -> Iterator[ProgressCallback]:
    """A rich progress display of the probe's phases, one line each as it starts (with its count where it has
    one), and the callback that feeds it. Transient on a terminal; elsewhere (a log, a pipe) it prints its
    final state once, when the probe is done."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvlab.probe.progress import UNITS

    bar = Progress(
        TextColumn("probe: {task.description:<12}"),
        BarColumn(),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        console=console,
        transient=console.is_terminal,
    )
    tasks: dict[str, Any] = {}

    def show(event: PhaseProgress) -> None:
        unit = UNITS.get(event.phase, "")
        if event.total is not None:
            count = f"{event.done}/{event.total} {unit}"
        else:
            count = f"{event.done} {unit}" if event.done else ""
        if event.phase not in tasks:
            tasks[event.phase] = bar.add_task(event.phase, total=event.total, count=count)
        if event.finished:  # a full bar, whether or not the phase had a count
            size = event.total if event.total is not None else max(event.done, 1)
            bar.update(tasks[event.phase], total=size, completed=size, count=count)
        else:
            bar.update(tasks[event.phase], completed=event.done, count=count)

    with bar:
        yield show


def _emit(
    text: str,
    doc: Document,
    json_out: Path | None,
    reports: Reports = (None, None),
    config: Path | None = None,
) -> None:
    """The text report (unless ``--json -``, or there is none), the JSON document (``kvlab.probe.schema``),
    SARIF (pointing at ``config``, the file that configured the run, if any) and JUnit."""
    from kvlab.probe.junit import write_junit
    from kvlab.probe.sarif import write_sarif
    from kvlab.probe.schema import dump

    if json_out != STDOUT and text:
        typer.echo(text)
    _write_json(json_out, dump(doc))
    sarif, junit = reports
    if sarif is not None:
        write_sarif(sarif, doc, config)
    if junit is not None:
        write_junit(junit, doc)
    for path in (p for p in reports if p is not None):
        out_console(json_out).print(f"wrote {path}", highlight=False)


STDOUT = Path("-")


def _write_json(path: Path | None, data: dict[str, Any]) -> None:
    """``--json PATH`` as in every command; ``--json -`` prints the JSON alone, for pipes."""
    if path == STDOUT:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        dump_json(path, data)


TimingTrials = Annotated[
    int,
    typer.Option(
        min=2,
        help="Hit/miss pairs per timing run (one run per victim shape and salt condition); raised, and said so, "
        "where too few could never reach the significance level. 8 sees an AUC of 0.95 over the default 12 "
        "tests, 12 one of 0.87 (the report says which)",
    ),
]
TimingAlpha = Annotated[
    float,
    typer.Option(
        "--alpha",
        callback=check_probability,
        help="Timing: the family-wise false-positive rate over every shape, salt condition and channel (a smaller "
        "one plans more pairs)",
    ),
]
DeterminismRepeats = Annotated[
    int, typer.Option(min=1, help="Each prompt alone again this many times (the server's own determinism)")
]
ReuseOption = Annotated[bool, typer.Option(help="Also probe non-prefix reuse (llama.cpp --cache-reuse)")]
ReuseGroupsOption = Annotated[
    Path | None, input_file("YAML file of non-prefix reuse groups (default: built-in reuse.yaml)")
]
ReuseTrials = Annotated[int, typer.Option(min=1, help="Victim/attacker trials per reuse group")]


def probe_cli(
    base_url: Annotated[str, typer.Option(help="Server root or its /v1 URL, e.g. http://127.0.0.1:8000/v1")],
    model: Annotated[str | None, typer.Option(help="Model name (default: the first id of /v1/models)")] = None,
    passphrases: Annotated[Path | None, input_file("YAML/JSON passphrase file (default: built-in)")] = None,
    concurrency: Annotated[int, typer.Option(min=1, max=256, help="Concurrent requests per burst")] = 8,
    rounds: Annotated[int, typer.Option(min=1, help="Bursts per passphrase group")] = 3,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per response")] = 16,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Seed of the probe's structure: burst order, arrival offsets, timing order (default 0); the texts "
            "are fresh every run. With --extract, of the secret"
        ),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the full report as JSON here ('-': print only the JSON)")
    ] = None,
    timing: Annotated[
        bool,
        typer.Option(
            help="Measure whether another client's cached prefix shows in TTFT or cached_tokens (several victim "
            "shapes, without and with salts, as many pairs as --alpha needs); --no-timing skips it"
        ),
    ] = True,
    search_tokens: Annotated[
        int,
        typer.Option(
            min=16,
            help="The cache granularity search's longest prefix, in tokens, where the model's context is longer "
            "or unknown (each length is a fresh prefill; a longer search sees larger blocks)",
        ),
    ] = 2048,
    max_seconds: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Time budget of the run in seconds (default 300): the granularity search, determinism, bursts, "
            "reuse and timing share it and measure fewer lengths, prompts, rounds, trials or pairs where the "
            "server is slow (the report says what was cut and the power it cost); 0: no bound. With --extract: "
            "no time bound unless given (--max-requests bounds it); once it has passed the attack stops",
        ),
    ] = None,
    timing_trials: TimingTrials = 8,
    alpha: TimingAlpha = 0.01,
    determinism_repeats: DeterminismRepeats = 2,
    reuse: ReuseOption = True,
    reuse_groups: ReuseGroupsOption = None,
    reuse_trials: ReuseTrials = 3,
    timing_prefix_chars: Annotated[
        int,
        typer.Option(
            min=32,
            help="Least length of the timing prompts' prefixes; longer where the server's cache blocks need it "
            "(measured first: at least two blocks, within the model's context)",
        ),
    ] = 400,
    request_timeout: Annotated[
        float, typer.Option(min=0.001, help="Seconds per attempt of a request before it times out (and is retried)")
    ] = 60.0,
    retries: Annotated[
        int,
        typer.Option(
            min=0,
            help="Further attempts of a request after a timeout, a connection error, a 429 or a 5xx (exponential "
            "backoff); one that still fails is dropped from its phase, and the report says so. Not with --extract: "
            "a retried guess could find its own first attempt cached and read as a hit",
        ),
    ] = 2,
    sarif: Annotated[Path | None, typer.Option(help="Also write the findings as SARIF 2.1.0 here")] = None,
    junit: Annotated[Path | None, typer.Option(help="Also write the findings as JUnit XML here")] = None,
    api_key: Annotated[str | None, typer.Option(help="API key of the probe (the attacker with --extract)")] = None,
    metrics_api_key: Annotated[
        str | None,
        typer.Option(
            help="Read /metrics with this key (an operator auditing their own server); without it the probe "
            "reads /metrics as a client could: without a key, then with --api-key"
        ),
    ] = None,
    extract: Annotated[
        bool,
        typer.Option(
            "--extract",
            help="Run the prompt-extraction attack instead: recover a simulated victim's secret via the cache",
        ),
    ] = False,
    victim_api_key: Annotated[
        str | None,
        typer.Option(
            help="The simulated victim's API key, for --extract and the timing (its requests carry it, the "
            "attacker's carry --api-key: tenant B measured against tenant A; default: both use --api-key)"
        ),
    ] = None,
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
        int,
        typer.Option(
            min=1, help="--extract, char strategy: most guesses per step (a step guesses up to a block boundary)"
        ),
    ] = 256,
    max_requests: Annotated[
        int,
        typer.Option(
            min=1,
            help="--extract: the attack's request budget, attacker and victim together (the token strategy tries "
            "every candidate of a step within it; a dictionary larger than it is out of reach)",
        ),
    ] = 16_000,
    prior_model: Annotated[
        str | None,
        typer.Option(
            help="--extract, token strategy: a local copy of the served model (kvlab model name, .gguf or HF "
            "directory) whose next-token distribution orders the guesses (default: --model's, where kvlab can "
            "load it; 'none': no local model)"
        ),
    ] = None,
    ttft_repeats: Annotated[int, typer.Option(min=2, help="--extract: TTFT samples per candidate")] = 5,
    victim_every: Annotated[
        int,
        typer.Option(
            min=1,
            help="--extract: the victim re-sends after this many attacker requests (1 for a server that keeps "
            "only each slot's last prompt, as llama.cpp's does)",
        ),
    ] = 16,
    strategy: Annotated[
        str,
        typer.Option(
            help="--extract: auto | char | token | dictionary | membership (auto: chosen from what the "
            "calibration measured; see kvlab.probe.attacks)"
        ),
    ] = "auto",
    dictionary: Annotated[
        Path | None, input_file("--extract: the secret's candidates, one a line (the dictionary strategy)")
    ] = None,
    candidates: Annotated[
        Path | None, input_file("--extract: whole prompts, one a line; the victim sends one (the membership strategy)")
    ] = None,
    decoys: Annotated[int, typer.Option(min=1, help="--extract membership: generated decoys per round")] = 7,
    membership_rounds: Annotated[
        int, typer.Option(min=1, help="--extract membership: rounds of a fresh victim prompt and decoys")
    ] = 3,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="--extract: a local copy of the server's tokenizer (kvlab model name, .gguf or HF directory; "
            "default: --model's, where kvlab can read it)"
        ),
    ] = None,
    attacker_salt: Annotated[str | None, typer.Option(help="--extract: cache_salt of the attacker's requests")] = None,
    victim_salt: Annotated[str | None, typer.Option(help="--extract: cache_salt of the victim's requests")] = None,
) -> None:
    """Black-box isolation check: do requests to an OpenAI-compatible server leak into each other's answers or
    timing? Exits 1 on a leak (an answer carrying another's state, a cache hit visible across salts; with
    --extract, a recovered secret), 3 when the only finding is exposure (a cache hit visible to clients without
    salts, in cached_tokens or TTFT), 2 when the probe fails or is misused, 0 otherwise."""
    from kvlab.openai_http import ModelDiscoveryError, discover_model, server_root
    from kvlab.probe.budget import DEFAULT_MAX_SECONDS
    from kvlab.probe.probe import ProbeConfig

    check_output_paths(json=json_out, sarif=sarif, junit=junit)  # a usage error: before the first request
    base_url = server_root(base_url)
    target = _Target(base_url, model)
    config = next((p for p in (passphrases, reuse_groups, dictionary, candidates) if p is not None), None)
    with _error_reports(target, json_out, (sarif, junit), config):
        if model is None:
            try:
                model = target.model = discover_model(base_url, api_key)
            except ModelDiscoveryError as exc:
                fail(str(exc))
        if extract:
            n = (secret_length, secret_length) if secret_length else (8, 12)
            _extract(
                base_url,
                model,
                json_out,
                api_key,
                victim_api_key,
                metrics_api_key,
                timeout=request_timeout,
                reports=(sarif, junit),
                config=config,
                alphabet=alphabet,
                secret=secret,
                secret_length=n,
                prefix=prefix,
                max_candidates=max_candidates,
                max_requests=max_requests,
                max_seconds=max_seconds or None,
                prior_model=prior_model,
                ttft_repeats=ttft_repeats,
                victim_every=victim_every,
                seed=seed,
                strategy=strategy,
                dictionary=_lines(dictionary),
                candidates=_lines(candidates),
                decoys=decoys,
                membership_rounds=membership_rounds,
                tokenizer=tokenizer,
                attacker_salt=attacker_salt,
                victim_salt=victim_salt,
            )
        cfg = ProbeConfig(
            concurrency=concurrency,
            rounds=rounds,
            max_tokens=max_tokens,
            seed=seed or 0,
            determinism_repeats=determinism_repeats,
            reuse_trials=reuse_trials,
            timing=timing,
            timing_trials=timing_trials,
            alpha=alpha,
            timing_prefix_chars=timing_prefix_chars,
            search_tokens=search_tokens,
            max_seconds=DEFAULT_MAX_SECONDS if max_seconds is None else max_seconds or None,
            request_timeout=request_timeout,
            retries=retries,
        )
        reports = (sarif, junit)
        args = (base_url, model, passphrases, reuse_groups, cfg, api_key, json_out, reuse, metrics_api_key, reports)
        _passphrase_probe(*args, victim_api_key=victim_api_key, config=config)
