#!/usr/bin/env bash
# Mutation testing of the isolation-critical files (pyproject.toml [tool.mutmut]; docs/testing.md has the last
# score and every surviving mutant, killed or explained). Slow: outside the default suite. Run it alone (it
# forks one test process per core).
#   bash scripts/mutation.sh            # run (resumes where a stopped run left off), then list the survivors
#   bash scripts/mutation.sh show NAME  # the diff of one mutant
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/mutmut ] || .venv/bin/python -m pip install -q -e '.[dev]'
if [ "${1:-}" = show ]; then
  exec .venv/bin/mutmut show "$2"
fi
.venv/bin/mutmut run --max-children "${MUTMUT_CHILDREN:-2}"
.venv/bin/mutmut results
