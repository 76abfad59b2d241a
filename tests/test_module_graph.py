"""The house's shape, checked: no import cycle anywhere in ``src/kvlab`` (every import counts, those inside a
function and under ``TYPE_CHECKING`` too), no private name imported from another module, no module over
``MAX_LINES`` (600) but a lump named in ``LUMPS`` with its ceiling (none today).

import-linter's contracts (``pyproject.toml``) hold the layers between packages; a cycle inside one package
(``probe.report`` <-> ``probe.schema`` was one) is what this file catches."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 600
# Modules allowed over MAX_LINES, each at most as long as its ceiling: none today (issue 37 split the last four).
# A kernel's own source would go here, with its reason.
LUMPS: dict[str, int] = {}


def module_files(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module imported, name imported from it or "") for every import statement of the module, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for a in node.names:
                submodule = f"{source}.{a.name}"
                found.append((submodule, "") if submodule in modules else (source, a.name))
    return found


def graph_of(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """The import graph between the modules under ``root``, and every private name imported across modules."""
    modules = module_files(root)
    edges: dict[str, set[str]] = defaultdict(set)
    private = []
    for name, path in modules.items():
        for source, imported in imports_of(name, path, modules):
            if source not in modules or source == name:
                continue
            edges[name].add(source)
            if imported.startswith("_") and not imported.startswith("__"):
                private.append(f"{name} imports {source}.{imported}")
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_and_no_private_import() -> None:
    edges, private = graph_of(SRC)
    assert not cycles(edges), f"import cycles (each a set of modules that import each other): {cycles(edges)}"
    assert not private, private


def test_no_new_lump() -> None:
    too_long = {}
    for name, path in module_files(SRC).items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > LUMPS.get(name, MAX_LINES):
            too_long[name] = lines
    assert not too_long, f"modules over {MAX_LINES} lines (or over their ceiling in LUMPS): {too_long}"


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """A planted cycle (through an import inside a function and a relative one) and a private import are found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (pkg / "b.py").write_text("from .c import _hidden\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    edges, private = graph_of(tmp_path)
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert private == ["pkg.b imports pkg.c._hidden"]


def test_every_lump_still_exists() -> None:
    """A lump split or renamed leaves its entry behind: take it out of LUMPS."""
    assert set(LUMPS) <= set(module_files(SRC))
