#!/usr/bin/env bash
# GPU checks for a machine with one CUDA GPU. Installs nothing from the network: it uses the
# torch already installed there, plus wheels carried along in .whl/ (if any) for the other
# dependencies. Prints: the gpu-marked tests, bf16 tokens/s, MFU and peak memory of a short
# Llama 3 1B training run, flex block_causal vs SDPA attention, bf16 vs float8 tokens/s and
# MFU (when torchao is installed), and (when the estimator is present) estimate vs measured
# memory.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/titan-site .whl/*.whl
  export PYTHONPATH=/tmp/titan-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

echo "== gpu tests"
"$PY" -m pytest -q -m gpu tests/unit_tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15

echo "== bf16 training: Llama 3 1B, seq 4096, local batch 2, selective AC, 30 steps"
NGPU=1 PYTHON="$PY" ./run_train.sh --model.flavor 1B --training.seq_len 4096 \
  --training.local_batch_size 2 --training.steps 30 --metrics.log_freq 5 \
  --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op \
  --lr_scheduler.warmup_steps 5 --job.dump_folder "$OUT/train_1b" 2>&1 | grep -E "step:|error|Error" | tail -8
"$PY" - "$OUT/train_1b/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
last = rows[-1]
print(f"steady state (step {last['step']}): {last['tps']:.0f} tokens/s, {last['tflops']:.1f} TFLOP/s, "
      f"MFU {last['mfu']:.1f}%, peak memory {last['memory_gib']:.2f} GiB, loss {rows[0]['loss']:.3f} -> {last['loss']:.3f}")
PYEOF

echo "== flex block_causal vs sdpa causal: one attention layer, seq 2048 and 8192"
"$PY" scripts/bench/attention_masks.py --seq-lens 2048,8192 2>&1 | tail -9

echo "== bf16 vs float8 (torchao): Llama 3 1B, seq 4096, local batch 2, selective AC, compiled, 30 steps"
if "$PY" -c "import torchao" >/dev/null 2>&1; then
  for precision in bf16 float8_tensorwise float8_rowwise; do
    extra=()
    case $precision in
      float8_*) extra=(--model.converters float8 --quantize.linear.float8.filter_fqns output
                       --quantize.linear.float8.recipe_name "${precision#float8_}") ;;
    esac
    NGPU=1 PYTHON="$PY" ./run_train.sh --model.flavor 1B --training.seq_len 4096 \
      --training.local_batch_size 2 --training.steps 30 --metrics.log_freq 5 --compile.enable \
      --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op \
      --lr_scheduler.warmup_steps 5 --job.dump_folder "$OUT/$precision" "${extra[@]}" 2>&1 \
      | grep -E "swapped|error|Error" | tail -3
  done
  "$PY" - "$OUT" <<'PYEOF'
import json, os, sys
rows = {p: [json.loads(l) for l in open(os.path.join(sys.argv[1], p, "metrics.jsonl"))]
        for p in ("bf16", "float8_tensorwise", "float8_rowwise")
        if os.path.exists(os.path.join(sys.argv[1], p, "metrics.jsonl"))}
base = rows.get("bf16", [{}])[-1].get("tps")
for name, r in rows.items():
    last = r[-1]
    speedup = f", {last['tps'] / base:.2f}x bf16" if base else ""
    print(f"{name}: {last['tps']:.0f} tokens/s{speedup}, MFU {last['mfu']:.1f}% (of the bf16 peak), "
          f"peak memory {last['memory_gib']:.2f} GiB, loss {r[0]['loss']:.3f} -> {last['loss']:.3f}")
PYEOF
else
  echo "torchao not installed here (carry its wheel in .whl/): float8 comparison skipped"
fi

if [ -f scripts/estimate/estimation.py ]; then
  echo "== memory estimate vs measured (same 1B layout, 1 GPU)"
  "$PY" scripts/estimate/estimation.py --model.flavor 1B --training.seq_len 4096 \
    --training.local_batch_size 2 --activation_checkpoint.mode selective \
    --activation_checkpoint.selective_ac_option op --memory_estimation.world_size 1 \
    --memory_estimation.mode measure 2>&1 | tail -20
fi
