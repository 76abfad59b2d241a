"""Does a refactor change what the commands print? Every ``--json -`` command of ``tests/test_cli_json.py``, run
at a base commit (a git worktree) and at the working tree, numbers and digits masked, compared key by key.

    .venv/bin/python scripts/compare_cli_json.py --base REV

Prints one line per command (``same`` or its differences) and exits 1 when any differs. Runs both sides one
after the other with the repo's interpreter (a few minutes on the mini model); nothing else should run beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RUN = "import sys; from kvlab.cli import app; sys.argv = ['kvlab', *sys.argv[1:]]; app()"


def commands() -> dict[str, list[str]]:
    sys.path.insert(0, str(REPO / "tests"))  # test_cli_json imports its neighbours
    spec = importlib.util.spec_from_file_location("test_cli_json", REPO / "tests" / "test_cli_json.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.COMMANDS)


def run(src: Path, args: list[str]) -> Any:
    with tempfile.TemporaryDirectory() as where:
        env = dict(os.environ, PYTHONPATH=str(src))
        done = subprocess.run(
            [sys.executable, "-c", RUN, *args, "--json", "-"], cwd=where, env=env, capture_output=True, text=True
        )
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {"exit": done.returncode, "stderr": done.stderr[-400:]}


def mask(x: Any) -> Any:
    """Numbers and digits out (they are measurements); lists cut to three entries plus a marker."""
    if isinstance(x, dict):
        return {k: mask(v) for k, v in x.items()}
    if isinstance(x, list):
        return [mask(v) for v in x[:3]] + (["..."] if len(x) > 3 else [])
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int | float):
        return "#"
    return re.sub(r"\d+(\.\d+)?", "#", x) if isinstance(x, str) else x


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only at the base" for k in a if k not in b]
        out += [f"{path}.{k}: only now" for k in b if k not in a]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = [f"{path}: {len(a)} entries at the base, {len(b)} now"] if len(a) != len(b) else []
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [f"{path}: {str(a)[:100]!r} -> {str(b)[:100]!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    base = parser.parse_args().base
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        add = ["git", "worktree", "add", "--detach", str(tree), base]
        subprocess.run(add, cwd=REPO, check=True, capture_output=True)
        try:
            changed = 0
            for name, args in commands().items():
                diff = differences(mask(run(tree / "src", args)), mask(run(REPO / "src", args)))
                changed += bool(diff)
                print(f"{name}: {'same' if not diff else f'{len(diff)} differences'}")
                for line in diff[:12]:
                    print(f"    {line}")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
