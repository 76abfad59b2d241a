"""``--json -`` means the same in every command: the JSON alone on stdout (tables and progress on stderr), and
no file named ``-``. (``probe`` and ``bench serve`` have their own tests against a server.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvlab.cli import app

COMMANDS = {
    "experiment": ["experiment", "--strategies", "isolated", "--trials", "2"],
    "divergence": ["divergence", "--trials", "1"],
    "fuzz": ["fuzz", "--trials", "2"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_json_dash_is_the_json_alone_on_stdout(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, [*COMMANDS[name], "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # nothing else on stdout
    assert isinstance(data, dict) and data
    assert not (tmp_path / "-").exists()
    # A path is a file, as before, and stdout keeps the tables.
    res = CliRunner().invoke(app, [*COMMANDS[name], "--json", "out.json"])
    assert res.exit_code == 0 and json.loads((tmp_path / "out.json").read_text()) and res.stdout.strip()
