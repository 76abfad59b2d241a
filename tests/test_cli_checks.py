"""Files are checked before the work (issue 38): a missing input or an output that cannot be written is one line
and exit 2 while the command line is parsed, not a raw errno or a traceback after the run; and every ``kvlab
bench`` subcommand shows its progress on a terminal (nothing drawn elsewhere)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import typer.main
from rich.console import Console
from typer.testing import CliRunner

from cli_output import words
from kvlab.cli import app


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a command loads a model or contacts a server before refusing its arguments."""
    import httpx

    import kvlab.model as model_pkg
    import kvlab.model.loader as loader

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work started before the arguments were checked")

    monkeypatch.setattr(loader, "load_model", refuse)
    monkeypatch.setattr(model_pkg, "load_model", refuse)
    monkeypatch.setattr(httpx.Client, "send", refuse)


def _refused(args: list[str], *said: str) -> None:
    res = CliRunner().invoke(app, args)
    text = words(res.output)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "Errno" not in text, res.output
    # The error panel wraps at the terminal's width, which can break a long path inside a word: compared with the
    # spaces taken out on both sides.
    squashed = "".join(text.split())
    for s in said:
        assert "".join(s.split()) in squashed, (s, res.output)


def test_trace_commands_refuse_a_missing_file_in_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.jsonl")
    for command in ("summarize", "explain", "timeline"):
        _refused(["trace", command, missing], "Invalid value for 'FILE'", "does not exist")
    _refused(["trace", "summarize", str(tmp_path)], "is a directory")


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["experiment", "--trace", "{nowhere}/t.jsonl"], "--trace"),
        (["experiment", "--json", "{nowhere}/r.json"], "--json"),
        (["divergence", "--plot", "{nowhere}/d.png"], "--plot"),
        (["attention", "--prompt", "hi there", "--plot", "{nowhere}/a.png"], "--plot"),
        (["attention", "--prompt", "hi there", "--compare-kv-heads", "2", "--compare-plot", "{nowhere}/c.png"],
         "--compare-plot"),
        (["bench", "sweep", "--plot", "{nowhere}/s.png"], "--plot"),
        (["bench", "sweep", "--cliff", "--plot", "{nowhere}/s.png"], "--plot"),
        (["bench", "scaling", "--plot", "{nowhere}/s.png"], "--plot"),
        (["bench", "layout", "--json", "{nowhere}/l.json"], "--json"),
        (["trace", "timeline", "{trace}", "--plot", "{nowhere}/t.png"], "--plot"),
        (["probe", "--base-url", "http://127.0.0.1:9", "--sarif", "{nowhere}/p.sarif"], "--sarif"),
    ],
)  # fmt: skip
def test_an_output_in_a_missing_folder_is_refused_before_the_work(
    nothing_runs: None, tmp_path: Path, args: list[str], flag: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    filled = [a.format(nowhere=tmp_path / "nowhere", trace=trace) for a in args]
    _refused(filled, f"{flag} {tmp_path / 'nowhere'}", "does not exist")


def test_an_output_folder_is_checked_before_the_work(nothing_runs: None, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    _refused(["experiment", "--report", str(a_file)], "--report", "is a file, not a folder")
    _refused(["experiment", "--report", str(a_file / "report")], "--report", "is a file, not a folder")
    _refused(["fuzz", "--cases-dir", str(a_file)], "--cases-dir", "is a file, not a folder")
    serve = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--save-result"]
    _refused([*serve, "--result-dir", str(a_file)], "--result-dir", "is a file, not a folder")
    _refused(["experiment", "--trace", str(tmp_path)], "--trace", "is a folder, not a file")


@pytest.mark.parametrize(
    "args",
    [
        ["experiment", "--passphrases", "{missing}"],
        ["probe", "--base-url", "http://127.0.0.1:9", "--passphrases", "{missing}"],
        ["probe", "--base-url", "http://127.0.0.1:9", "--reuse-groups", "{missing}"],
        ["probe", "--base-url", "http://127.0.0.1:9", "--extract", "--dictionary", "{missing}"],
        ["probe", "--base-url", "http://127.0.0.1:9", "--extract", "--candidates", "{missing}"],
        ["fuzz", "--replay", "{missing}"],
        ["serve", "--api-keys-file", "{missing}"],
        ["memory", "--config", "{missing}"],
    ],
)
def test_a_missing_input_file_is_refused_before_the_work(nothing_runs: None, tmp_path: Path, args: list[str]) -> None:
    missing = tmp_path / "missing.yaml"
    _refused([a.format(missing=missing) for a in args], str(missing))


def _bench_commands() -> list[str]:
    return list(typer.main.get_command(app).commands["bench"].commands)  # type: ignore[attr-defined]


# Each bench subcommand with arguments that parse and then fail inside the command, at once (a model that does not
# exist, a preset that does not, prefixes longer than the prompts): the progress display is up by then.
FAILING_INSIDE = {
    "memory": ["--preset", "nope"],
    "manager": ["--shared-prefixes", "200", "--prompt-tokens", "16"],
    "serve": ["--base-url", "http://127.0.0.1:9", "--model", "nope"],
}


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """The commands' console as a terminal writing into the returned buffer."""
    import kvlab.cli.common as common

    screen = io.StringIO()
    monkeypatch.setattr(common, "console", Console(file=screen, force_terminal=True, width=120))
    return screen


@pytest.mark.parametrize("name", _bench_commands())
def test_every_bench_subcommand_shows_progress_on_a_terminal(terminal: io.StringIO, name: str) -> None:
    res = CliRunner().invoke(app, ["bench", name, *FAILING_INSIDE.get(name, ["--model", "nope"])])
    assert res.exit_code == 2, res.output
    assert f"bench {name}" in terminal.getvalue(), terminal.getvalue()


def test_bench_progress_names_its_phases_and_is_gone_where_no_terminal(
    terminal: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["bench", "memory", "--sequences", "4", "--max-seq-len", "64", "--sharing", "2:20:2"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    shown = terminal.getvalue()
    assert "bench memory: paging" in shown and "bench memory: sharing" in shown
    assert "prefix" in shown  # the tables printed under the display, on the same console
    import kvlab.cli.common as common

    piped = io.StringIO()
    monkeypatch.setattr(common, "console", Console(file=piped, force_terminal=False, width=120))
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "bench memory" not in piped.getvalue() and "prefix" in piped.getvalue()


def test_bench_progress_goes_to_stderr_when_only_stderr_is_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvlab bench ... > results.txt`` watched on a terminal: the tables in the file, the progress on screen."""
    import kvlab.cli.common as common

    tables, screen = io.StringIO(), io.StringIO()
    monkeypatch.setattr(common, "console", Console(file=tables, force_terminal=False, width=120))
    monkeypatch.setattr(common, "stderr_console", lambda: Console(file=screen, force_terminal=True, width=120))
    res = CliRunner().invoke(app, ["bench", "memory", "--sequences", "4", "--max-seq-len", "64", "--sharing", "2:20:2"])
    assert res.exit_code == 0, res.output
    assert "bench memory: sharing" in screen.getvalue() and "bench memory" not in tables.getvalue()
    assert "prefix" in tables.getvalue() and "prefix" not in screen.getvalue()
