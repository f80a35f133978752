#!/usr/bin/env bash
# Fault-tolerant training on one machine: a torchft lighthouse and REPLICAS replica groups, each
# a run_train.sh job of NGPU processes (its own FSDP/TP/... layout), every group logging to
# {dump_folder}/replica_<id>.log. Kill a group's processes and start it again with
# REPLICA_IDS=<id> (and TORCHFT_LIGHTHOUSE of the running lighthouse): it heals from a live
# group and rejoins.
#   REPLICAS=2 NGPU=2 ./scripts/run_ft_replicas.sh --training.steps 100
# Env: REPLICAS (default 2), REPLICA_IDS (default: all, 0 .. REPLICAS-1), NGPU (processes per
# group, default 1), MIN_REPLICAS (groups needed for a step, default 1), TORCHFT_LIGHTHOUSE
# (an already running lighthouse; default: start one on LIGHTHOUSE_PORT, default 29510),
# CONFIG_FILE, DUMP_FOLDER (default ./outputs). On GPUs each group sees its own NGPU devices.
# Across nodes: start `torchft_lighthouse --min_replicas 1 --bind [::]:29510` once, then on
# each group's node(s) run run_train.sh (NNODES/MASTER_ADDR as usual) with
# TORCHFT_LIGHTHOUSE=http://<lighthouse host>:29510 --fault_tolerance.enable
# --fault_tolerance.group_size N --fault_tolerance.replica_id <id>.
set -euo pipefail
cd "$(dirname "$0")/.."
REPLICAS=${REPLICAS:-2}
NGPU=${NGPU:-1}
MIN_REPLICAS=${MIN_REPLICAS:-1}
DUMP_FOLDER=${DUMP_FOLDER:-./outputs}
REPLICA_IDS=${REPLICA_IDS:-$(seq -s ' ' 0 $((REPLICAS - 1)))}
BIN=.venv/bin
[ -x "$BIN/torchft_lighthouse" ] || BIN=$(dirname "$(command -v python3)")
mkdir -p "$DUMP_FOLDER"

lighthouse_pid=""
if [ -z "${TORCHFT_LIGHTHOUSE:-}" ]; then
  port=${LIGHTHOUSE_PORT:-29510}
  "$BIN/torchft_lighthouse" --min_replicas "$MIN_REPLICAS" --bind "[::]:$port" \
    > "$DUMP_FOLDER/lighthouse.log" 2>&1 &
  lighthouse_pid=$!
  export TORCHFT_LIGHTHOUSE=http://localhost:$port
  sleep 1
fi
trap '[ -n "$lighthouse_pid" ] && kill "$lighthouse_pid" 2>/dev/null || true' EXIT
echo "lighthouse: $TORCHFT_LIGHTHOUSE"

export RUST_LOG=${RUST_LOG:-warn}  # torchft logs every quorum at INFO
gpus=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
pids=()
for id in $REPLICA_IDS; do
  devices=()
  if [ "$gpus" -gt 0 ]; then
    devices=(env CUDA_VISIBLE_DEVICES=$(seq -s, $((id * NGPU)) $((id * NGPU + NGPU - 1))))
  fi
  "${devices[@]}" env NGPU="$NGPU" ./run_train.sh --job.dump_folder "$DUMP_FOLDER" \
    --fault_tolerance.enable --fault_tolerance.group_size "$REPLICAS" \
    --fault_tolerance.replica_id "$id" --fault_tolerance.min_replica_size "$MIN_REPLICAS" "$@" \
    > "$DUMP_FOLDER/replica_$id.log" 2>&1 &
  pids+=($!)
  echo "replica group $id: pid $!, log $DUMP_FOLDER/replica_$id.log"
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
