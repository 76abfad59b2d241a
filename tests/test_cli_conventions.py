"""One way to say each thing on the command line (issue 38): every option name whole in --help at 80 columns,
switches that take no value, values named in words, one name for a PNG, seeds named for what they seed, one
rule for lists (``--requests`` always a comma list), ranges and keys as vLLM users write them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from cli_output import words
from kvlab.cli import app
from kvlab.cli.commands import spread_values

ROOT = typer.main.get_command(app)


def _commands(cmd: Any = ROOT, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command and group of ``kvlab``, with the words that name it."""
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands())


def _options(cmd: Any) -> list[Any]:
    return [p for p in cmd.get_params(typer.Context(cmd)) if p.param_type_name == "option" and not p.hidden]


def _help(path: tuple[str, ...], width: int = 80) -> str:
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(width)}, terminal_width=width)
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "kvlab")
def test_every_option_name_is_whole_in_help_at_80_columns(path: tuple[str, ...]) -> None:
    """Typer's rich table cut 14 of serve's names (``--served-model-…``) and 5 of probe's at 80 columns."""
    text = _help(path)
    names = [name for p in _options(COMMANDS[path]) for name in (*p.opts, *p.secondary_opts)]
    assert names, path
    cut = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
    assert cut == [], f"cut at 80 columns: {cut}"
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "kvlab")
def test_switches_take_no_value_and_values_are_named_in_words(path: tuple[str, ...]) -> None:
    cmd = COMMANDS[path]
    ctx = typer.Context(cmd)
    for p in _options(cmd):
        record = p.get_help_record(ctx)[0]
        if p.is_flag:
            # A switch: its names alone (--flag, or --flag / --no-flag when it is on by default).
            rest = record
            for name in (*p.opts, *p.secondary_opts):
                rest = rest.replace(name, "")
            assert rest.strip(" ,/;") == "", record
            assert bool(p.secondary_opts) == (p.default is True), f"{p.opts[0]}: off by default, so no --no- form"
        else:
            # A value: a word (INTEGER, PATH, KEY[:TENANT]...) or a choice's values, never a Python type.
            for label in re.findall(r"<([^>]*)>", record):
                assert "|" in label, f"{p.opts[0]} shows a type name: {record}"
            assert not re.search(r"list\[|tuple|bool|NoneType", record), record
    assert "<bool>" not in _help(path, width=120)


def test_save_result_is_shown_as_the_switch_it_is() -> None:
    text = _help(("bench", "serve"))
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("--save-result")]
    assert line.split()[1] == "Also", line  # help text follows the name: no value column
    res = CliRunner().invoke(app, ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--save-result", "true"])
    assert res.exit_code == 2 and "unexpected extra argument(s) (true)" in words(res.output)


def test_a_png_is_always_plot() -> None:
    """A PNG was --plot in divergence, sweep and scaling, --out in attention and trace timeline."""
    pngs = {
        (path, p.opts[0])
        for path, cmd in COMMANDS.items()
        for p in _options(cmd)
        if p.metavar == "PNG" or "png" in (p.help or "").lower()
    }
    assert pngs == {
        (("divergence",), "--plot"),
        (("attention",), "--plot"),
        (("attention",), "--compare-plot"),
        (("bench", "sweep"), "--plot"),
        (("bench", "scaling"), "--plot"),
        (("trace", "timeline"), "--plot"),
    }
    assert all(p.metavar == "PNG" for _, cmd in COMMANDS.items() for p in _options(cmd) if "--plot" in p.opts)
    assert not [path for path, cmd in COMMANDS.items() for p in _options(cmd) if "--out" in p.opts]


def test_each_seed_is_named_for_what_it_seeds() -> None:
    """--weights-seed: a mini model's random weights (serve, attention, as LLM(weights_seed=...)); --seed: the
    command's own randomness, said in its help."""
    seeds = {path: p for path, cmd in COMMANDS.items() for p in _options(cmd) if "--seed" in p.opts}
    assert set(seeds) == {
        ("experiment",),
        ("divergence",),
        ("probe",),
        ("fuzz",),
        ("bench", "serve"),
        ("bench", "tenants"),
        ("serve",),
    }
    for path, p in seeds.items():
        assert p.help.startswith("Seed of") and "weight" not in p.help, (path, p.help)
    weights = {path for path, cmd in COMMANDS.items() for p in _options(cmd) if "--weights-seed" in p.opts}
    assert weights == {("serve",), ("attention",)}


def test_requests_is_a_comma_list_wherever_it_is() -> None:
    """--requests was a comma list in throughput and serve, one integer in sweep, cow and manager: one count is
    --num-prompts (vLLM's word, requests sent) or --num-requests now."""
    found = {path: p for path, cmd in COMMANDS.items() for p in _options(cmd) if "--requests" in p.opts}
    assert set(found) == {("bench", "throughput"), ("bench", "serve")}
    assert all(p.metavar == "N,..." for p in found.values())
    counts = {path for path, cmd in COMMANDS.items() for p in _options(cmd) if "--num-prompts" in p.opts}
    assert counts == {
        ("bench", "sweep"),
        ("bench", "cow"),
        ("bench", "fidelity"),
        ("bench", "serve"),
        ("bench", "speculative"),
    }
    # Every option takes one word: no option of several space-separated values (a tuple) is left.
    assert not [(path, p.opts) for path, cmd in COMMANDS.items() for p in _options(cmd) if p.nargs != 1]


@pytest.mark.parametrize(
    ("value", "ok"), [("200,2000", True), ("16,16", True), ("200", False), ("2000,200", False), ("1,2,3", False)]
)
def test_ranges_are_comma_separated_like_every_list(monkeypatch: pytest.MonkeyPatch, value: str, ok: bool) -> None:
    """--system-tokens 200,2000 failed with "requires 2 arguments"; the README's rule is commas."""
    import kvlab.cli.bench.tenants as tenants

    def stop(*args: object, **kwargs: object) -> None:
        raise typer.Exit(0)  # parsed and its workload built: the model would load now

    monkeypatch.setattr(tenants, "load_or_exit", stop)
    res = CliRunner().invoke(app, ["bench", "tenants", "--system-tokens", value])
    if ok:
        assert res.exit_code == 0, res.output
    else:
        assert res.exit_code == 2 and "expected MIN,MAX" in words(res.output), res.output


def test_one_api_key_flag_takes_several_keys_as_vllm_serve() -> None:
    assert spread_values(["--api-key", "k1", "k2:bob", "--port", "0"], ["--api-key"]) == [
        "--api-key",
        "k1",
        "--api-key",
        "k2:bob",
        "--port",
        "0",
    ]
    ended = ["mini", "--api-key", "k1", "--", "k2"]  # -- ends the options: k2 is not a key
    assert spread_values(ended, ["--api-key"]) == ended
    assert spread_values(["--api-key=k1", "k2"], ["--api-key"]) == ["--api-key=k1", "k2"]
    assert spread_values(["--host", "h", "x"], ["--api-key"]) == ["--host", "h", "x"]


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ServerConfig ``kvlab serve`` builds from its command line, the server never started (nor a model
    loaded)."""
    import kvlab.cli.serve as serve_cli
    import kvlab.server.serve as server

    configs: list[Any] = []

    def build_app(cfg: Any, loaded: Any) -> None:
        configs.append(cfg)
        raise typer.Exit(0)

    monkeypatch.setattr(server, "build_app", build_app)
    monkeypatch.setattr(serve_cli, "load_or_exit", lambda *a, **k: None)
    monkeypatch.setattr(serve_cli, "set_threads", lambda *a, **k: 1)
    return configs


@pytest.mark.parametrize(
    "args",
    [
        ["--api-key", "k1", "k2:bob"],  # before: "unknown model 'k2:bob'"
        ["mini", "--api-key", "k1", "k2:bob", "--port", "0"],
        ["--api-key", "k1", "--api-key", "k2:bob"],
        ["--model", "mini", "--api-key", "k1", "k2:bob"],
    ],
)
def test_serve_reads_several_keys_after_one_flag(served: list[Any], args: list[str]) -> None:
    res = CliRunner().invoke(app, ["serve", *args])
    assert res.exit_code == 0, res.output
    (cfg,) = served
    assert cfg.model == "mini" and cfg.api_keys == {"k1": "tenant-1", "k2": "bob"}


def test_serve_flags_reach_the_server_config(served: list[Any]) -> None:
    args = ["serve", "--weights-seed", "7", "--seed", "3"]
    args += ["--allowed-host", "a.example,b.example:8000", "--allowed-host", "c"]
    args += ["--kv-cache-dtype", "fp8_e5m2"]
    res = CliRunner().invoke(app, [*args, "--served-model-name", "m", "--access-log", "--trust-salt-header"])
    assert res.exit_code == 0, res.output
    (cfg,) = served
    assert (cfg.weights_seed, cfg.seed) == (7, 3) and cfg.served_model_name == "m" and cfg.trust_salt_header is True
    assert cfg.allowed_hosts == ("a.example", "b.example:8000", "c")
    assert cfg.cache["kv_cache_dtype"] == "fp8_e5m2"


def test_bench_serve_takes_vllms_served_model_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvlab.bench.serve as bench_serve

    sent: list[str | None] = []

    def run(*args: Any, served_model: str | None = None, **kwargs: Any) -> None:
        sent.append(served_model)
        raise bench_serve.ServeBenchError("stopped by the test")

    monkeypatch.setattr(bench_serve, "bench_serve", run)
    args = ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--served-model-name", "smollm2", "--requests", "1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "stopped by the test" in res.output
    assert sent == ["smollm2"]
