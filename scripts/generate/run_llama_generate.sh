#!/usr/bin/env bash
# Generate text from a checkpoint, tensor-parallel over NGPU processes (1 = no TP).
#   NGPU=2 CONFIG_FILE=train_configs/debug_model.toml CHECKPOINT_DIR=outputs/checkpoint \
#     PROMPT="def main(" ./scripts/generate/run_llama_generate.sh --max_new_tokens 64
# Extra args go to test_generate.py (its own options, then config overrides).
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)" 2>/dev/null || echo 1)
fi
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-outputs/checkpoint}
PROMPT=${PROMPT:-}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}

exec "$PYTHON" -m torchtitan.distributed.launch --standalone --nproc_per_node="$NGPU" \
  --local-ranks-filter 0 scripts/generate/test_generate.py \
  --config "$CONFIG_FILE" --checkpoint "$CHECKPOINT_DIR" --prompt "$PROMPT" "$@"
