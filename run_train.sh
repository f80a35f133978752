#!/usr/bin/env bash
# Launch training with torchrun.
#   NGPU=4 CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh --training.steps 20
# Env: NGPU (default: visible CUDA devices, else 1), NNODES / NODE_RANK / MASTER_ADDR /
# MASTER_PORT for multi-node (MASTER_ADDR required there; scripts/run_train.slurm sets them
# under SLURM), LOG_RANK (global ranks whose logs are shown; default: the rank that shows the loss,
# 0 unless pipeline parallel puts the last stage elsewhere), CONFIG_FILE (default: the
# Llama 3 debug config), DRY_RUN=1 (check the config, print the launch command, run
# nothing), MAX_RESTARTS (default 0: how often torchrun restarts the ranks after a failure;
# with checkpoint.enable a restart resumes from the newest complete checkpoint). Extra args
# are CLI overrides. Callable from any directory: that directory goes on PYTHONPATH (for
# --experimental.custom_import) and a relative CONFIG_FILE is taken from it; everything
# else (the default config, paths inside configs and flags) is relative to this repository.
set -euo pipefail
caller_dir=$PWD
cd "$(dirname "$0")"
export PYTHONPATH="$caller_dir${PYTHONPATH:+:$PYTHONPATH}"

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)" 2>/dev/null || echo 1)
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
MASTER_PORT=${MASTER_PORT:-29500}
if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  echo "error: MASTER_ADDR: set it to the address of node 0 for a run on NNODES=$NNODES nodes" >&2
  exit 2
fi
if [ -z "${CONFIG_FILE:-}" ]; then
  CONFIG_FILE=train_configs/debug_model.toml
elif [[ $CONFIG_FILE != /* ]]; then
  CONFIG_FILE=$caller_dir/$CONFIG_FILE
fi

# Validate the merged config, the parallel layout and the inputs (data, tokenizer,
# checkpoint, converters, device features) once, in one process, so that bad input prints
# one line once (exit 2) instead of a traceback per rank. It prints the rank
# that shows the loss (the last pipeline stage's first rank), the default LOG_RANK. Its
# warnings only on a dry run: the trainer prints them again.
quiet=--quiet
if [ "${DRY_RUN:-0}" = 1 ]; then quiet=""; fi
loss_rank=$("$PYTHON" -m torchtitan.preflight --world-size $((NGPU * NNODES)) --print-loss-rank $quiet \
  --job.config_file "$CONFIG_FILE" "$@") || exit $?
LOG_RANK=${LOG_RANK:-$loss_rank}

# One node: a standalone rendezvous on localhost. Several: only the address the user names.
if [ "$NNODES" -gt 1 ]; then
  rdzv=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --rdzv_backend=c10d
        --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT")
else
  rdzv=(--standalone)
fi
# LOG_RANK names global ranks; torchrun filters by this node's local ranks (node N holds
# global ranks N*NGPU .. N*NGPU+NGPU-1). A node without one shows its local rank 0 (whose
# warnings and errors still print).
local_log_ranks=""
IFS=, read -ra log_ranks <<< "$LOG_RANK"
for rank in "${log_ranks[@]}"; do
  local_rank=$((rank - NODE_RANK * NGPU))
  if [ "$local_rank" -ge 0 ] && [ "$local_rank" -lt "$NGPU" ]; then
    local_log_ranks+="${local_log_ranks:+,}$local_rank"
  fi
done
export LOG_RANK
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}
launch=("$PYTHON" -m torchtitan.distributed.launch --nproc_per_node="$NGPU" "${rdzv[@]}"
        --max-restarts="$MAX_RESTARTS"
        --local-ranks-filter "${local_log_ranks:-0}"
        -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "LOG_RANK=$LOG_RANK OMP_NUM_THREADS=$OMP_NUM_THREADS PYTHONPATH=${PYTHONPATH@Q} ${launch[*]@Q}"
  exit 0
fi
exec "${launch[@]}"
