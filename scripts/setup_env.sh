#!/usr/bin/env bash
# Creates .venv (once) with torch and torchtitan installed in editable mode with the dev extra.
# On a machine without CUDA it installs the CPU build torch==2.13.0 first, so that pip never
# pulls a multi-GB CUDA build to satisfy "torch>=2.11".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.torchtitan-installed"
want=$(cat pyproject.toml | sha1sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# (grep drops the local package mirror's notices about index folders it does not have)
pip_install() {
  "$VENV/bin/python" -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: CUDA device found, installing torch with CUDA support" >&2
    pip_install "torch>=2.11"
  else
    echo "setup: no CUDA device, installing the CPU build torch==2.13.0" >&2
    pip_install "torch==2.13.0"
  fi
fi
echo "setup: installing torchtitan (editable, dev extra)" >&2
pip_install -e ".[dev]"
echo "$want" > "$stamp"
