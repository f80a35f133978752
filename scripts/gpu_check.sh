#!/usr/bin/env bash
# GPU checks for a machine with one CUDA GPU. Installs nothing from the network: it uses the
# torch already installed there (2.11 or newer), plus wheels carried along in .whl/ (if any)
# for the other dependencies.
#
# Checks, each printing "PASS: <what> (<numbers>)" or "FAIL: <what> (<numbers>)":
#   - the gpu-marked tests (pytest -m gpu) pass, among them fla's fused gated delta rule
#     against ours (tests/unit_tests/test_fla_delta_rule.py; skipped without the fla_core wheel);
#   - a short Llama 3 1B bf16 training run completes, its loss stays finite and falls by 5 %
#     or more, its MFU is above 1 % and at most 100 %, and its peak memory lies between
#     16 bytes per parameter (fp32 weights, gradients and two AdamW states) and the GPU's memory;
#   - the flex-vs-SDPA attention benchmark and the bf16 / float8 (torchao) runs complete;
#   - the memory estimator's estimate (--memory_estimation.mode measure, target cuda) is
#     within 5 % of the measured peak of the same steps;
#   - the chunked loss (Llama 3 1B, seq 8192 x 2) lowers the peak by 4 GiB or more against
#     the full logits at 95 % or more of its tokens/s with the same first step (loss and
#     gradient norm), and so does Liger Kernel's fused loss (when its wheel is carried).
# GPU_CHECK_SECTIONS picks sections (default: all of tests training attention float8
# estimate loss), e.g. GPU_CHECK_SECTIONS="tests loss" bash scripts/gpu_check.sh.
# Figures printed beside them: tokens/s, TFLOP/s, MFU and memory of each run, flex block_causal
# vs SDPA attention, float8 speed-up over bf16. The script ends with every FAIL line again and
# exits 1 if any check failed, 0 otherwise. Without a CUDA device it stops at once:
# "FAIL: no CUDA device (...)".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FAILED=()
CHECKS=0

verdict() { # verdict <exit status> <what> <numbers>: PASS for status 0, else FAIL
  CHECKS=$((CHECKS + 1))
  if [ "$1" -eq 0 ]; then
    echo "PASS: $2 ($3)"
  else
    echo "FAIL: $2 ($3)"
    FAILED+=("FAIL: $2 ($3)")
  fi
}

report() { # report <exit status> <what> <lines>: print the lines of a check script, count
  # its PASS/FAIL lines, and fail <what> itself if the script did not run to its end
  local line
  while IFS= read -r line; do
    echo "$line"
    case $line in
      PASS:*) CHECKS=$((CHECKS + 1)) ;;
      FAIL:*) CHECKS=$((CHECKS + 1)); FAILED+=("$line") ;;
    esac
  done <<<"$3"
  if [ "$1" -ne 0 ]; then verdict "$1" "$2 evaluated" "the check script exited $1"; fi
}

cuda_probe='import sys, torch
ok = torch.cuda.is_available() and torch.cuda.device_count() > 0
what = torch.cuda.get_device_name(0) if ok else "torch.cuda.is_available() is False"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}: {what}")
sys.exit(0 if ok else 1)'
if ! device=$("$PY" -c "$cuda_probe" 2>&1); then
  echo "FAIL: no CUDA device (${device##*$'\n'})"
  exit 1
fi
echo "device: $device"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/titan-site .whl/*.whl
  export PYTHONPATH=/tmp/titan-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

check_tests() {
echo "== gpu tests"
"$PY" -m pytest -q -m gpu tests -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1
status=$?
tail -15 "$OUT/gpu_tests.log"
verdict "$status" "gpu-marked tests" "$(tail -1 "$OUT/gpu_tests.log")"
}

check_training() {
echo "== bf16 training: Llama 3 1B, seq 4096, local batch 2, selective AC, 30 steps"
NGPU=1 PYTHON="$PY" ./run_train.sh --model.flavor 1B --training.seq_len 4096 \
  --training.local_batch_size 2 --training.steps 30 --metrics.log_freq 5 \
  --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op \
  --lr_scheduler.warmup_steps 5 --job.dump_folder "$OUT/train_1b" >"$OUT/train_1b.log" 2>&1
status=$?
grep -E "step:|error|Error" "$OUT/train_1b.log" | tail -8
verdict "$status" "1B training run completed" "exit $status, log $OUT/train_1b.log"
if [ "$status" -eq 0 ]; then
  checks=$("$PY" - "$OUT/train_1b" "$OUT/train_1b.log" <<'PYEOF'
import json, math, re, sys
import torch

def check(ok, what, numbers):
    print(f"{'PASS' if ok else 'FAIL'}: {what} ({numbers})")

rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if l.strip()]
first, last = rows[0], rows[-1]
print(f"steady state (step {last['step']}): {last['tps']:.0f} tokens/s, {last['tflops']:.1f} TFLOP/s, "
      f"MFU {last['mfu']:.1f}%, peak memory {last['memory_gib']:.2f} GiB, loss {first['loss']:.3f} -> {last['loss']:.3f}")
losses = [r["loss"] for r in rows]
check(all(math.isfinite(x) for x in losses) and losses[-1] <= 0.95 * losses[0],
      "training loss finite and falling by 5% or more",
      f"steps {first['step']}-{last['step']}: " + " ".join(f"{x:.3f}" for x in losses))
check(1.0 < last["mfu"] <= 100.0, "training MFU above 1% and at most 100%", f"MFU {last['mfu']:.2f}%")
found = re.search(r"model \S+ \S+: ([\d,]+) parameters", open(sys.argv[2]).read())
params = int(found.group(1).replace(",", "")) if found else 0
low = 16 * params / 2**30
high = torch.cuda.get_device_properties(0).total_memory / 2**30
check(found is not None and low <= last["memory_gib"] <= high,
      "training peak memory between 16 B per parameter and the GPU's memory",
      f"{last['memory_gib']:.2f} GiB; bounds {low:.2f}-{high:.2f} GiB for {params:,} parameters")
PYEOF
  )
  report $? "training metrics" "$checks"
fi
}

check_attention() {
echo "== flex block_causal vs sdpa causal: one attention layer, seq 2048 and 8192"
"$PY" scripts/bench/attention_masks.py --seq-lens 2048,8192 >"$OUT/attention.log" 2>&1
status=$?
tail -9 "$OUT/attention.log"
verdict "$status" "attention benchmark completed" "exit $status, log $OUT/attention.log"
}

check_float8() {
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
      --lr_scheduler.warmup_steps 5 --job.dump_folder "$OUT/$precision" "${extra[@]}" \
      >"$OUT/$precision.log" 2>&1
    status=$?
    grep -E "swapped|error|Error" "$OUT/$precision.log" | tail -3
    verdict "$status" "$precision compiled training run completed" "exit $status, log $OUT/$precision.log"
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
}

check_estimate() {
echo "== memory estimate vs measured (same 1B layout, 1 GPU)"
"$PY" scripts/estimate/estimation.py --model.flavor 1B --training.seq_len 4096 \
  --training.local_batch_size 2 --activation_checkpoint.mode selective \
  --activation_checkpoint.selective_ac_option op --memory_estimation.world_size 1 \
  --memory_estimation.mode measure --memory_estimation.target_device cuda \
  >"$OUT/estimate.log" 2>&1
status=$?
tail -20 "$OUT/estimate.log"
verdict "$status" "memory estimator (mode measure) completed" "exit $status, log $OUT/estimate.log"
checks=$("$PY" - "$OUT/estimate.log" <<'PYEOF'
import re, sys
text = open(sys.argv[1]).read()
estimate = re.search(r"estimate \(fake tensors, rank 0 of \d+\): ([\d,]+) B", text)
measured = re.search(r"torch\.cuda\.max_memory_allocated ([\d,]+) B", text)
what = "memory estimate within 5% of the measured peak"
if estimate is None or measured is None:
    print(f"FAIL: {what} (no estimate or no torch.cuda.max_memory_allocated figure in the output)")
    sys.exit()
e, m = (int(x.group(1).replace(",", "")) for x in (estimate, measured))
error = (e - m) / m
print(f"{'PASS' if abs(error) <= 0.05 else 'FAIL'}: {what} "
      f"(estimate {e / 2**30:.3f} GiB, measured {m / 2**30:.3f} GiB, {error:+.2%})")
PYEOF
)
report $? "memory estimate" "$checks"
}

check_loss() {
echo "== chunked loss vs full logits: Llama 3 1B (vocabulary 128,256), seq 8192, local batch 2, selective AC, 20 steps"
local kernels=(native) kernel chunk tokenizer=$OUT/tokenizer_128k
"$PY" scripts/bench/padded_tokenizer.py "$tokenizer" >/dev/null  # Llama 3's vocabulary size
if "$PY" -c "import liger_kernel" >/dev/null 2>&1; then kernels+=(liger); fi
for kernel in "${kernels[@]}"; do
  for chunk in 0 -1; do
    if [ "$kernel" = liger ] && [ "$chunk" = 0 ]; then continue; fi
    NGPU=1 PYTHON="$PY" ./run_train.sh --model.flavor 1B --training.seq_len 8192 \
      --training.local_batch_size 2 --training.steps 20 --metrics.log_freq 5 \
      --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op \
      --lr_scheduler.warmup_steps 5 --training.loss_chunk_size "$chunk" \
      --training.loss_kernel "$kernel" --model.tokenizer_path "$tokenizer" --job.dump_folder "$OUT/loss_${kernel}_$chunk" \
      >"$OUT/loss_${kernel}_$chunk.log" 2>&1
    status=$?
    grep -E "loss: |error|Error" "$OUT/loss_${kernel}_$chunk.log" | tail -2
    verdict "$status" "1B run, loss kernel $kernel, loss_chunk_size $chunk" \
      "exit $status, log $OUT/loss_${kernel}_$chunk.log"
  done
done
checks=$("$PY" - "$OUT" <<'PYEOF'
import json, os, sys

def check(ok, what, numbers):
    print(f"{'PASS' if ok else 'FAIL'}: {what} ({numbers})")

def rows(name):
    path = os.path.join(sys.argv[1], name, "metrics.jsonl")
    return [json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else None

full, chunked, liger = rows("loss_native_0"), rows("loss_native_-1"), rows("loss_liger_-1")
for name, r in (("full logits", full), ("chunked", chunked), ("liger", liger)):
    if r:
        print(f"{name}: {r[-1]['tps']:.0f} tokens/s, MFU {r[-1]['mfu']:.1f}%, peak memory "
              f"{r[-1]['memory_gib']:.2f} GiB, losses " + " ".join(f"{x['loss']:.4f}" for x in r))
def same_first_step(a, b):
    """bf16: the first step's loss and gradient norm (same weights, same batch) agree; later
    steps drift apart as bf16 runs do."""
    loss, norm = (abs(a[0][k] - b[0][k]) / b[0][k] for k in ("loss", "grad_norm"))
    return loss <= 1e-3 and norm <= 2e-2, f"step 1 loss {loss:.1e}, grad norm {norm:.1e} apart"

if full and chunked:
    check(full[-1]["memory_gib"] - chunked[-1]["memory_gib"] >= 4.0,
          "chunked loss lowers the 1B seq 8192 x 2 peak by 4 GiB or more",
          f"{full[-1]['memory_gib']:.2f} -> {chunked[-1]['memory_gib']:.2f} GiB")
    check(chunked[-1]["tps"] >= 0.95 * full[-1]["tps"], "chunked loss within 5% of the full-logits tokens/s",
          f"{full[-1]['tps']:.0f} -> {chunked[-1]['tps']:.0f} tokens/s")
    ok, numbers = same_first_step(chunked, full)
    check(ok, "chunked and full-logits first steps agree (bf16)", numbers)
if liger and chunked:
    ok, numbers = same_first_step(liger, chunked)
    check(ok, "Liger Kernel's and our chunked first steps agree (bf16)",
          f"{numbers}; peak {liger[-1]['memory_gib']:.2f} vs {chunked[-1]['memory_gib']:.2f} GiB")
PYEOF
)
report $? "chunked loss metrics" "$checks"
}

ALL_SECTIONS="tests training attention float8 estimate loss"
for section in ${GPU_CHECK_SECTIONS:-$ALL_SECTIONS}; do
  case " $ALL_SECTIONS " in
    *" $section "*) "check_$section" ;;
    *) verdict 1 "GPU_CHECK_SECTIONS names $section" "known: $ALL_SECTIONS" ;;
  esac
done

echo "== summary"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "${#FAILED[@]} of $CHECKS checks failed:"
  printf '%s\n' "${FAILED[@]}"
  exit 1
fi
echo "all $CHECKS checks passed"
