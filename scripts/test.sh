#!/usr/bin/env bash
# The test command: sets up .venv if needed, then (for the whole suite, what CI runs) lints
# and format-checks the tree with ruff, runs the suite (CPU, gloo) in a random order, and runs
# the fast suite once more as on a CPU of the other kind (bf16 matmuls native where this CPU
# emulates them, emulated where it has them).
# Extra args go to pytest and run only that, e.g. `bash scripts/test.sh tests/unit_tests -k config`.
# The order's seed is printed first: TEST_ORDER_SEED=N repeats that order, and the pytest
# flag --randomly-dont-reorganize keeps the files' own order.
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
seed=${TEST_ORDER_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
echo "test order: --randomly-seed $seed (TEST_ORDER_SEED=$seed repeats it)"
suite() { .venv/bin/python -m pytest -q -n 2 --dist loadfile --randomly-seed "$seed" "$@"; }
if [ $# -gt 0 ]; then
  suite --durations=40 "$@"
  exit
fi
suite --durations=40 tests
other=$(.venv/bin/python -m tests.hermetic)
echo "the fast suite again with bf16 matmuls $other (this CPU's are not)"
suite -m "not multiprocess and not slow" --cpu-bf16 "$other" tests
