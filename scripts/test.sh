#!/usr/bin/env bash
# The test command: sets up .venv if needed, then (for the whole suite, what CI runs) lints
# and format-checks the tree with ruff, then runs the suite (CPU, gloo).
# Extra args go to pytest and skip the lint, e.g. `bash scripts/test.sh tests/unit_tests -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [ $# -eq 0 ]; then
  .venv/bin/ruff check --quiet . || { echo "lint failed: ruff check (fix with .venv/bin/ruff check --fix .)" >&2; exit 1; }
  .venv/bin/ruff format --check --quiet . || { echo "format check failed: run .venv/bin/ruff format ." >&2; exit 1; }
fi
# Compiled bytecode goes to a temporary cache even where PYTHONDONTWRITEBYTECODE is set:
# otherwise every rank of every launch compiles torchtitan again (~0.35 s of CPU each).
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-${TMPDIR:-/tmp}/torchtitan-pycache}"
# Two pytest workers, each test file on one of them (-n 0 after the arguments runs in one),
# each computing with half the cores (more threads than cores makes both spin and wait).
threads=$(( $(nproc) / 2 ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
exec .venv/bin/python -m pytest -q --durations=40 -n 2 --dist loadfile "${@:-tests}"
