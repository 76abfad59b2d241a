#!/usr/bin/env bash
# Mutation testing of the isolation-critical files (pyproject.toml [tool.mutmut]; docs/testing.md has the last
# score and every surviving mutant, killed or explained). Slow: outside the default suite. Run it alone (it
# forks one test process per core).
#   bash scripts/mutation.sh            # run (resumes where a stopped run left off), then list the survivors
#   bash scripts/mutation.sh deep       # re-run the survivors with the KV state machine added to the tests
#   bash scripts/mutation.sh show NAME  # the diff of one mutant
#   bash scripts/mutation.sh fresh [GLOB...]  # forget every result and mutate the sources as they are now: mutmut
#                                       # keeps its copy of the tree (mutants/), stale after a source change, and
#                                       # resets its results anyway when the test selection changes
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/mutmut ] || .venv/bin/python -m pip install -q -e '.[dev]'
case "${1:-}" in
  show)
    exec .venv/bin/mutmut show "$2" ;;
  deep)
    # The state machine takes a minute or more per run, too slow for every mutant: it is added for the
    # survivors only, in a copy of the configuration that is put back however the run ends.
    mapfile -t survivors < <(.venv/bin/mutmut results 2>/dev/null | awk '/: survived/ {sub(":$", "", $1); print $1}')
    [ "${#survivors[@]}" -gt 0 ] || { echo "no survivors"; exit 0; }
    cp pyproject.toml pyproject.toml.mutation-backup
    trap 'mv pyproject.toml.mutation-backup pyproject.toml' EXIT
    sed -i 's|^    "tests/kv/test_kv_promotion.py",|    "tests/kv/test_kv_state_machine.py",\n&|' pyproject.toml
    .venv/bin/mutmut run --max-children "${MUTMUT_CHILDREN:-2}" "${survivors[@]}" ;;
  fresh)
    shift
    rm -rf mutants
    .venv/bin/mutmut run --max-children "${MUTMUT_CHILDREN:-2}" "$@" ;;
  *)
    .venv/bin/mutmut run --max-children "${MUTMUT_CHILDREN:-2}" ;;
esac
.venv/bin/mutmut results
