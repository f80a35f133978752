#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite (CPU, gloo).
# Extra args go to pytest, e.g. `bash scripts/test.sh tests/unit_tests -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q --durations=40 "${@:-tests}"
