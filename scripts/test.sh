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
exec .venv/bin/python -m pytest -q --durations=40 "${@:-tests}"
