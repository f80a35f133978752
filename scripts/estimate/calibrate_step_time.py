"""Fit the step-time model's shares of peak on published runs and check it on the others.

Every row of upstream torchtitan's Llama 3.1 H100 benchmark tables (numbers in
``../shared/reference/published-throughput.md``) is written as a job config (our TOML for the
model plus the row's overrides), predicted by ``--time``'s model and, for memory, by the
closed form. Five rows fit the five constants of ``step_time.Efficiency`` (marked "fit");
every other row is a check. Prints the table (markdown); ``--write`` also saves it to
``benchmarks/step_time_calibration.md``.

    python scripts/estimate/calibrate_step_time.py [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.estimate.build import TrainingBuild  # noqa: E402
from torchtitan.estimate.step_time import CALIBRATED, StepInputs, step_time  # noqa: E402
from torchtitan.estimate.time_mode import step_inputs  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402

OUT = REPO / "benchmarks" / "step_time_calibration.md"

COMPILE = ["--compile.enable"]
FLOAT8 = [
    "--model.converters",
    "float8",
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
]
SELECTIVE_OP = [
    "--activation_checkpoint.mode",
    "selective",
    "--activation_checkpoint.selective_ac_option",
    "op",
]
FULL_AC = ["--activation_checkpoint.mode", "full"]
ASYNC_TP = ["--parallelism.enable_async_tensor_parallel"]


def layout(dp_shard: int, tp: int = 1, pp: int = 1, cp: int = 1) -> list[str]:
    world = dp_shard * tp * pp * cp
    return [
        "--parallelism.data_parallel_shard_degree", str(dp_shard),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.pipeline_parallel_degree", str(pp),
        "--parallelism.context_parallel_degree", str(cp),
        "--memory_estimation.world_size", str(world),
    ]  # fmt: skip


def batch(seq_len: int, local: int, global_: int) -> list[str]:
    return [
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(local),
        "--training.global_batch_size", str(global_),
    ]  # fmt: skip


@dataclass(frozen=True, eq=False)
class Row:
    table: str
    label: str
    flavor: str
    overrides: list[str]
    tokens_per_second: float  # published, per GPU
    memory_gib: float  # published, the maximum over GPUs
    fits: str = ""  # the constant this row fits, or "" for a check


T1 = batch(8192, 2, 16) + layout(8) + SELECTIVE_OP
T2 = FULL_AC + COMPILE + FLOAT8
T3 = batch(8192, 2, 256) + layout(128) + SELECTIVE_OP
T4 = batch(8192, 16, 512) + layout(32, tp=8) + FULL_AC + COMPILE + FLOAT8
# 405B: micro-batches of 4 sequences = 8 per local batch, the pipeline degree (the default of
# torchtitan at the time); Interleaved1F1B with 2 stages per rank (our default)
T5 = batch(8192, 32, 256) + layout(8, tp=8, pp=8) + FULL_AC + COMPILE + FLOAT8 + ASYNC_TP
T5 += ["--parallelism.pipeline_parallel_microbatch_size", "4"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
T6 = (
    FULL_AC + COMPILE + FLOAT8 + ASYNC_TP + ["--parallelism.pipeline_parallel_microbatch_size", "1"]
)

ROWS = [
    Row("1: 8B, 8 GPUs", "FSDP", "8B", T1, 5762, 82.4, "eager_slowdown"),
    Row("1: 8B, 8 GPUs", "FSDP + compile", "8B", T1 + COMPILE, 6667, 77.0, "matmul"),
    Row(
        "1: 8B, 8 GPUs",
        "FSDP + compile + float8",
        "8B",
        T1 + COMPILE + FLOAT8,
        8532,
        76.8,
        "float8_matmul",
    ),
    Row(
        "2: 8B, 8 GPUs, CP",
        "FSDP 8, seq 32k",
        "8B",
        batch(32768, 1, 8) + layout(8) + T2,
        3890,
        83.9,
        "attention",
    ),
    Row(
        "2: 8B, 8 GPUs, CP",
        "FSDP 4 x CP 2, seq 64k",
        "8B",
        batch(65536, 1, 4) + layout(4, cp=2) + T2,
        2540,
        84.2,
    ),
    Row(
        "2: 8B, 8 GPUs, CP",
        "FSDP 2 x CP 4, seq 128k",
        "8B",
        batch(131072, 1, 2) + layout(2, cp=4) + T2,
        1071,
        84.0,
    ),
    Row(
        "2: 8B, 8 GPUs, CP",
        "CP 8, seq 256k",
        "8B",
        batch(262144, 1, 1) + layout(1, cp=8) + T2,
        548,
        84.5,
    ),
    Row("3: 8B, 128 GPUs", "FSDP", "8B", T3, 5605, 67.0),
    Row("3: 8B, 128 GPUs", "FSDP + compile", "8B", T3 + COMPILE, 6514, 62.0),
    Row("3: 8B, 128 GPUs", "FSDP + compile + float8", "8B", T3 + COMPILE + FLOAT8, 8380, 61.8),
    Row("4: 70B, 256 GPUs", "FSDP 32 x TP 8", "70B", T4, 829, 71.9),
    Row(
        "4: 70B, 256 GPUs",
        "FSDP 32 x TP 8 + async TP",
        "70B",
        T4 + ASYNC_TP,
        876,
        67.6,
        "async_tp_hidden",
    ),
    Row("5: 405B, 512 GPUs", "1F1B", "405B", T5, 100, 82.5),
    Row("5: 405B, 512 GPUs", "Interleaved 1F1B", "405B", T5 + INTERLEAVED, 128, 72.7),
    Row(
        "6: 405B, 512 GPUs, CP",
        "FSDP 8, seq 32k",
        "405B",
        batch(32768, 8, 64) + layout(8, tp=8, pp=8) + T6,
        76,
        75.3,
    ),
    Row(
        "6: 405B, 512 GPUs, CP",
        "FSDP 4 x CP 2, seq 64k",
        "405B",
        batch(65536, 8, 32) + layout(4, tp=8, pp=8, cp=2) + T6,
        47,
        75.9,
    ),
    Row(
        "6: 405B, 512 GPUs, CP",
        "FSDP 2 x CP 4, seq 128k",
        "405B",
        batch(131072, 8, 16) + layout(2, tp=8, pp=8, cp=4) + T6,
        31,
        77.1,
    ),
    Row(
        "6: 405B, 512 GPUs, CP",
        "CP 8, seq 256k",
        "405B",
        batch(262144, 8, 8) + layout(1, tp=8, pp=8, cp=8) + T6,
        16,
        84.9,
    ),
]


PREAMBLE = """# Step-time model: calibration on published H100 runs

`python scripts/estimate/calibrate_step_time.py --write` writes this file. Each row is one
row of upstream torchtitan's Llama 3.1 benchmark tables (H100s with 500 W limit, 8 per host,
NVLink within a host, 400 Gb/s RDMA per GPU between hosts), written as our job config
(`train_configs/llama3_{8b,70b,405b}.toml` plus the row's overrides, listed in the script) and
predicted by the model behind `--time` and mode plan's ranking
(`torchtitan/estimate/step_time.py`) on the H100 SXM data sheet (989 TFLOP/s bf16, 1,979
float8, NVLink 450 GB/s per direction).

Five constants are fitted, each on one row (role "fits"); the other 13 rows are checks.
`collective` (achieved NCCL bus bandwidth over link bandwidth) is set to 0.8, not fitted.
Assumed where the tables are silent: float8 is tensorwise with float8 all-gather and
precomputed scales; selective AC of the 8B rows is per op (the 8B config of that commit);
405B pipelines run 8 micro-batches per step (torchtitan's default then: the pipeline degree)
and Interleaved1F1B holds 2 stages per rank; the vocabulary is Llama 3's 128,256."""

NOTES = """Notes:
- MFU counts the trainer's FLOPs per token (6 per weight, attention over the whole sequence)
  against the bf16 peak, as the published MFU figures do.
- Within each table the predicted order of the rows is the published one
  (`tests/unit_tests/test_step_time.py` checks it, and that every check row but the three
  below stays within 15 %).
- The misses: context parallel at 4 and 8 ranks of the 8B table (+27 %, +33 %) and at 8 ranks
  of the 405B table (+30 %). The published runs slow down there by more than any traffic
  explains: at 128k tokens over CP 4 the keys and values each rank receives add up to ~48 GiB
  per step, 0.2 s over NVLink in a 30 s step, yet the published step is 27 % longer than the
  32k row's attention efficiency predicts. The model keeps the traffic it can count rather
  than a factor fitted to those rows.
- Memory: the published figure is the maximum memory the caching allocator reserved, which
  depends on its fragmentation; the estimator traces allocations, and its plan adds
  `reserved_margin` (15 %) for the reserve. The closed form does not model per-op selective
  AC, float8 linears or async TP, which every published row uses; the trace covers them. The
  two rows whose configuration is fully specified (eager, bf16; the loss on the full logits,
  `--training.loss_chunk_size 0`, as torchtitan computed it then), traced on this machine:
  table 1 FSDP 68.04 GiB allocated, + 15 % = 78.2 GiB vs 82.4 published (-5.1 %); table 3
  FSDP 57.52 GiB, + 15 % = 66.1 GiB vs 67.0 (-1.3 %). Not traced here: the compiled rows
  (inductor's fusions change what is kept; our trace is eager), and 70B and 405B (their
  traces take long on 2 cores)."""


def job_args(row: Row) -> list[str]:
    toml = REPO / "train_configs" / f"llama3_{row.flavor.lower()}.toml"
    return [
        "--job.config_file",
        str(toml),
        "--memory_estimation.gpus_per_node",
        "8",
    ] + row.overrides


def build_of(row: Row) -> TrainingBuild:
    config = ConfigManager().parse_args(job_args(row))
    return TrainingBuild(config, config.memory_estimation.world_size, "cuda")


def inputs_of(row: Row) -> StepInputs:
    build = build_of(row)
    return step_inputs(build, build.parallel_dims())


def fit(inputs: dict[Row, StepInputs]) -> dict[str, float]:
    """Each marked row's constant, found by bisection with the others fixed, repeated until
    they settle (each row depends mostly on its own constant)."""
    constants = dataclasses.asdict(CALIBRATED)
    for _ in range(30):
        for row, x in inputs.items():
            if row.fits:
                constants[row.fits] = _solve(row, x, constants)
    return constants


def _solve(row: Row, x: StepInputs, constants: dict[str, float]) -> float:
    def predicted(value: float) -> float:
        efficiency = dataclasses.replace(CALIBRATED, **{**constants, row.fits: value})
        return step_time(dataclasses.replace(x, efficiency=efficiency)).tokens_per_second_per_gpu

    low, high = (1.0, 3.0) if row.fits == "eager_slowdown" else (1e-3, 1.0)
    rising = predicted(high) > predicted(low)
    for _ in range(60):
        middle = math.sqrt(low * high)
        if (predicted(middle) < row.tokens_per_second) == rising:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


def table(constants: dict[str, float], inputs: dict[Row, StepInputs]) -> list[str]:
    efficiency = dataclasses.replace(CALIBRATED, **constants)
    lines = [
        "| table | row | published tok/s/GPU | predicted | error | predicted MFU | role "
        "| published GiB (max reserved) |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for row, x in inputs.items():
        predicted = step_time(dataclasses.replace(x, efficiency=efficiency))
        tps = predicted.tokens_per_second_per_gpu
        error = (tps - row.tokens_per_second) / row.tokens_per_second
        role = f"fits {row.fits}" if row.fits else "check"
        lines.append(
            f"| {row.table} | {row.label} | {row.tokens_per_second:,.0f} | {tps:,.0f} | "
            f"{error:+.1%} | {predicted.mfu:.1%} | {role} | {row.memory_gib} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"also write {OUT.relative_to(REPO)}")
    args = parser.parse_args()
    init_logger()
    inputs = {row: inputs_of(row) for row in ROWS}
    constants = fit(inputs)
    fitted = ", ".join(f"{k} {v:.4g}" for k, v in constants.items())
    lines = [PREAMBLE, "", f"Fitted: {fitted}.", ""] + table(constants, inputs) + ["", NOTES]
    print("\n".join(lines))
    if args.write:
        OUT.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
