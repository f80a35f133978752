#!/usr/bin/env bash
# Memory estimation for NGPU x NNODES ranks, on any machine (no GPU needed).
#   NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./scripts/estimate/run_memory_estimation.sh
#   NGPU=8 NNODES=8 ./scripts/estimate/run_memory_estimation.sh --memory_estimation.mode plan \
#       --memory_estimation.device_memory_gib 80
# Extra args are config overrides.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
NGPU=${NGPU:-8}
NNODES=${NNODES:-1}
CONFIG_FILE=${CONFIG_FILE:-train_configs/llama3_8b.toml}
exec "$PYTHON" scripts/estimate/estimation.py --job.config_file "$CONFIG_FILE" \
  --memory_estimation.world_size $((NGPU * NNODES)) "$@"
