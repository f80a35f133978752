"""Throughput, MFU, step-time breakdown, peak memory and framework overhead of the trainer.

    python scripts/bench/benchmark.py --config train_configs/debug_model.toml --nproc 1 \\
        --steps 30 --warmup 8 --repeats 5 --max-load 1.5 \\
        --output benchmarks/debug_model_cpu_1proc.md [trainer overrides]

Each repeat runs, one after the other:

- the trainer, exactly as ``run_train.sh`` would (``torchrun -m torchtitan.train``, one
  thread per core split over the processes), logging every step to ``metrics.jsonl``; its
  own profiler records the last step;
- ``scripts/bench/bare_loop.py``: the same model, batches, optimizer, autocast and clipping
  in a plain PyTorch loop on one process with the same thread count, profiled the same way.

Steady state is steps ``warmup+1 .. steps-4`` (the last four run under the profiler). The
overhead of a repeat is the trainer's median step time over the bare loop's (the two run
back to back, so that the state of the machine hits both alike); the headline is the
median over the repeats that other load on the machine did not disturb (see
``STEADY_SPREAD``; ``--max-load`` waits for a quiet machine before each run). The breakdown
comes from the profiled step's host-side trace: data (the data loader),
forward+backward (from the batch to the end of the last autograd function),
optimizer (``Optimizer.step``), other (the rest: clipping, metrics, syncs), and
communication (union of collective events on any thread or stream; it overlaps the rest).
Options this script does not know are trainer overrides, passed to both runs.

``--preset upstream-debug`` is the workload on which this framework is compared with
upstream torchtitan (Llama 3 debug model, upstream's 2,000-token test tokenizer, a corpus
of CPython's standard-library docstrings written by ``make_stdlib_docs_corpus.py``, seq 2048,
local batch 8, bf16 autocast, every 2nd block checkpointed, 30 steps):

    python scripts/bench/benchmark.py --preset upstream-debug --nproc 1 \\
        --output benchmarks/upstream_debug_1proc.md
    python scripts/bench/benchmark.py --preset upstream-debug --nproc 2 \\
        --output benchmarks/upstream_debug_fsdp2.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "scripts" / "bench"
BARE_LOOP = BENCH_DIR / "bare_loop.py"
PROFILED_STEPS = 4  # the profiler's 3 warm-up steps + the recorded one
OVERHEAD_LIMIT = 1.05
STEADY_SPREAD = 1.05  # a run whose median step exceeds its fastest by more was disturbed
_COMM_MARKERS = ("gloo:", "nccl", "c10d::")


@dataclass(frozen=True)
class Preset:
    config: str
    steps: int
    warmup: int
    overrides: tuple[str, ...]


UPSTREAM_DEBUG = Preset(
    config="train_configs/debug_model.toml",
    steps=30,
    warmup=5,
    overrides=(
        "--model.tokenizer_path",
        str(BENCH_DIR / "upstream_test_tokenizer"),
        "--training.seq_len",
        "2048",
        "--training.local_batch_size",
        "8",
        "--training.mixed_precision_param",
        "bfloat16",
        "--training.mixed_precision_reduce",
        "float32",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
        "--optimizer.lr",
        "8e-4",
        "--lr_scheduler.warmup_steps",
        "1",
        "--lr_scheduler.decay_ratio",
        "0.8",
        "--lr_scheduler.decay_type",
        "linear",
        "--lr_scheduler.min_lr_factor",
        "0.0",
        "--debug.seed",
        "42",
    ),
)
PRESETS = {"upstream-debug": UPSTREAM_DEBUG}


def preset_overrides(preset: Preset, nproc: int, corpus: Path) -> list[str]:
    """The preset's trainer flags for ``nproc`` processes (FSDP over all of them, one data
    shard per rank as upstream reads its data), with the corpus written to ``corpus``."""
    subprocess.run(
        [sys.executable, str(BENCH_DIR / "make_stdlib_docs_corpus.py"), str(corpus)],
        check=True,
        capture_output=True,
    )
    layout = ["--parallelism.data_parallel_shard_degree", str(nproc)] if nproc > 1 else []
    return [
        *preset.overrides,
        "--training.dataset",
        "json",
        "--training.dataset_path",
        str(corpus),
        "--training.data_shards",
        str(nproc),
        *layout,
    ]


@dataclass
class RunStats:
    label: str
    step_times: list[float]  # steady-state steps, seconds
    tokens_per_second: float  # per device
    tflops: float
    mfu: float
    memory_gib: float
    losses: list[float]  # every step
    breakdown: dict[str, float]  # seconds of the profiled step
    load: float = 0.0  # the machine's 1-minute load average when the run ended

    @property
    def median_step(self) -> float:
        return statistics.median(self.step_times)

    @property
    def min_step(self) -> float:
        return min(self.step_times)

    @property
    def steady(self) -> bool:
        return self.median_step <= STEADY_SPREAD * self.min_step


# ---------------------------------------------------------------------------- trace
def step_breakdown(trace: Path) -> dict[str, float]:
    """Host-side phases of the one ``ProfilerStep`` in a chrome trace, in seconds."""
    events = [
        e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e
    ]
    step = next(e for e in events if e["name"].startswith("ProfilerStep#"))
    start, end = step["ts"], step["ts"] + step["dur"]
    inside = [e for e in events if start <= e["ts"] and e["ts"] + e["dur"] <= end]
    main = [e for e in inside if e["tid"] == step["tid"]]

    def named(prefix: str, pool: list[dict]) -> list[dict]:
        return [e for e in pool if e["name"].startswith(prefix)]

    data = named("enumerate(DataLoader)", main)
    zero_grad = named("Optimizer.zero_grad", main)
    backward = named("autograd::engine::evaluate_function", inside)
    optimizer = sum(e["dur"] for e in named("Optimizer.step", main))
    data_time = sum(e["dur"] for e in data)
    first = data[0] if data else (zero_grad[0] if zero_grad else None)
    fb_start = first["ts"] + first["dur"] if first else start
    fb_end = max((e["ts"] + e["dur"] for e in backward), default=fb_start)
    later_data = sum(e["dur"] for e in data[1:])  # micro-batches of gradient accumulation
    forward_backward = fb_end - fb_start - later_data
    comm = _union(
        [
            (e["ts"], e["ts"] + e["dur"])
            for e in inside
            if any(m in e["name"] for m in _COMM_MARKERS)
        ]
    )
    phases = {
        "step": step["dur"],
        "data": data_time,
        "forward_backward": forward_backward,
        "optimizer": optimizer,
        "other": step["dur"] - data_time - forward_backward - optimizer,
        "communication": comm,
    }
    return {k: v / 1e6 for k, v in phases.items()}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


# ---------------------------------------------------------------------------- runs
def _env(threads: int) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }


def _run(cmd: list[str], threads: int) -> str:
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(threads), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"exit {result.returncode}: {shlex.join(cmd)}\n"
            f"{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return result.stdout


def run_trainer(args: argparse.Namespace, overrides: list[str], folder: Path) -> RunStats:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "-m",
        "torchtitan.train",
        "--job.config_file",
        args.config,
        *overrides,
        "--job.dump_folder",
        str(folder),
        "--training.steps",
        str(args.steps),
        "--metrics.log_freq",
        "1",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        str(args.steps),
    ]
    _run(cmd, args.threads)
    with open(folder / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    steady = [r for r in records if args.warmup < r["step"] <= args.steps - PROFILED_STEPS]
    seconds = sum(r["step_time"] for r in steady)
    trace = next((folder / "profile_traces").glob("iteration_*/rank0_trace.json"))
    return RunStats(
        label="trainer",
        step_times=[r["step_time"] for r in steady],
        tokens_per_second=sum(r["tps"] * r["step_time"] for r in steady) / seconds,
        tflops=sum(r["tflops"] * r["step_time"] for r in steady) / seconds,
        mfu=sum(r["mfu"] * r["step_time"] for r in steady) / seconds,
        memory_gib=max(r["memory_gib"] for r in records),
        losses=[r["loss"] for r in records],
        breakdown=step_breakdown(trace),
    )


def run_bare_loop(args: argparse.Namespace, overrides: list[str], folder: Path) -> RunStats:
    trace = folder / "bare_trace.json"
    cmd = [
        sys.executable,
        str(BARE_LOOP),
        "--trace",
        str(trace),
        "--job.config_file",
        args.config,
        *overrides,
        "--training.steps",
        str(args.steps),
    ]
    result = json.loads(_run(cmd, args.threads).strip().splitlines()[-1])
    step_times = result["step_times"][args.warmup : args.steps - PROFILED_STEPS]
    tps = result["tokens_per_step"] * len(step_times) / sum(step_times)
    flops = result["flops_per_token"] * tps
    return RunStats(
        label="bare loop",
        step_times=step_times,
        tokens_per_second=tps,
        tflops=flops / 1e12,
        mfu=100 * flops / result["peak_flops"],
        memory_gib=result["memory_gib"],
        losses=result["losses"],
        breakdown=step_breakdown(trace),
    )


def wait_for_quiet(max_load: float | None, timeout: float = 1800) -> None:
    """Wait (up to ``timeout`` s) until the 1-minute load average is below ``max_load``."""
    deadline = time.monotonic() + timeout
    while max_load is not None and os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(15)


# ---------------------------------------------------------------------------- report
def _git(*cmd: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), *cmd], capture_output=True, text=True
    ).stdout.strip()


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}"
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in lscpu.splitlines()
            if line.startswith("Model name")
        ),
        platform.processor(),
    )
    return f"{model}, {os.cpu_count()} cores (CPU)"


def _row(stats: RunStats, repeat: str) -> str:
    b = stats.breakdown
    pct = " | ".join(
        f"{100 * b[k] / b['step']:.1f}%"
        for k in ("data", "forward_backward", "optimizer", "other", "communication")
    )
    return (
        f"| {stats.label} | {repeat} | {stats.tokens_per_second:,.0f} | {stats.tflops:.3f} | "
        f"{stats.mfu:.2f}% | {1e3 * stats.median_step:.1f} | {1e3 * stats.min_step:.1f} | "
        f"{1e3 * b['step']:.1f} | {pct} | {stats.memory_gib:.2f} | {stats.load:.1f} |"
    )


def _loss_agreement(trainer: RunStats, bare: RunStats) -> str:
    pairs = list(zip(trainer.losses, bare.losses, strict=True))
    worst = max(abs(a - b) / abs(a) for a, b in pairs)
    return (
        f"the per-step losses of the trainer and the bare loop agree within {worst:.1e} (relative) "
        f"over all {len(pairs)} steps (first {pairs[0][0]:.6f}, "
        f"last {pairs[-1][0]:.6f} / {pairs[-1][1]:.6f})"
    )


def _per_rank_workload(nproc: int) -> str:
    return (
        f"each of the {nproc} trainer ranks runs the bare loop's batch size (the trainer's global "
        f"batch is {nproc}x larger, so the losses differ); the ratio includes communication"
    )


def precision_case(config: str, overrides: list[str]) -> str:
    """What the runs compute in: the trainer's CPU precision decision for this workload on
    this machine (training.cpu_low_precision), or the configured dtype."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import default_device_type
    from torchtitan.tools.cpu_precision import resolve_cpu_precision

    training = ConfigManager().parse_args(["--job.config_file", config, *overrides]).training
    decided = resolve_cpu_precision(training, default_device_type())
    case = f"compute in {training.mixed_precision_param}, parameters in {training.dtype}"
    return case + (f" ({decided})" if decided else " (as configured)")


def report(
    args: argparse.Namespace, argv: list[str], runs: list[tuple[RunStats, RunStats]], precision: str
) -> str:
    import torch

    steady = [(t, b) for t, b in runs if t.steady and b.steady]
    counted = steady or runs
    ratios = [trainer.median_step / bare.median_step for trainer, bare in counted]
    ratio = statistics.median(ratios)
    min_ratios = [trainer.min_step / bare.min_step for trainer, bare in counted]
    dirty = (
        " (with uncommitted changes)"
        if _git("status", "--porcelain", "--untracked-files=no")
        else ""
    )
    lines = [
        f"# Benchmark: `{args.config}`, {args.nproc} process(es)",
        "",
        f"- command: `python scripts/bench/benchmark.py {shlex.join(argv)}`",
        f"- commit: `{_git('rev-parse', 'HEAD')}`{dirty}",
        f"- torch {torch.__version__}, Python {platform.python_version()}",
        f"- machine: {machine()}; {args.threads} thread(s) per process",
        f"- precision: {precision}",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- steady state: steps {args.warmup + 1}..{args.steps - PROFILED_STEPS} of {args.steps}; "
        f"{len(runs)} interleaved repeat(s)",
        "- same workload: "
        f"{_loss_agreement(*runs[0]) if args.nproc == 1 else _per_rank_workload(args.nproc)}",
        "",
        "| run | repeat | tokens/s/device | TFLOP/s | MFU | step median (ms) | step min (ms) "
        "| profiled step (ms) | data | fwd+bwd | optimizer | other | comm (overlaps) "
        "| peak memory (GiB) | load avg |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, (trainer, bare) in enumerate(runs, 1):
        mark = "" if trainer.steady and bare.steady else " (disturbed)"
        lines += [_row(trainer, f"{i}{mark}"), _row(bare, f"{i}{mark}")]
    verdict = (
        ""
        if args.nproc > 1
        else (
            f"; {'within' if ratio <= OVERHEAD_LIMIT else 'ABOVE'} the "
            f"{OVERHEAD_LIMIT:.2f} limit for one process"
        )
    )
    lines += [
        "",
        f"**Framework overhead: trainer / bare-loop median step time = {ratio:.3f}** (median over "
        f"{'the ' + str(len(steady)) + ' undisturbed' if steady else 'all (none undisturbed!)'}"
        f" repeats{verdict}). A repeat is disturbed (by other load on the "
        f"machine) when a run's median step exceeds its fastest by more than "
        f"{100 * (STEADY_SPREAD - 1):.0f}%. Per counted repeat: "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + f"; with the fastest step of each run instead of the "
        f"median: {statistics.median(min_ratios):.3f} ("
        + ", ".join(f"{r:.3f}" for r in min_ratios)
        + ").",
        "",
        "tokens/s, TFLOP/s and MFU are means over the steady-state steps (the trainer's "
        "metrics.jsonl fields). data .. comm are shares of the one profiled step, whose time "
        "includes the profiler's own overhead (host-side: on CUDA, GPU work shows where the host "
        "waits for it). MFU uses `torchtitan/tools/peaks.py` `peak_flops` "
        "(GPU data sheet; on CPU the measured matmul peak in the same dtype).",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named workload: its config, steps, warm-up and trainer flags",
    )
    parser.add_argument("--config", default=None, help="default: train_configs/debug_model.toml")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="default: 40")
    parser.add_argument("--warmup", type=int, default=None, help="default: 10")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--threads", type=int, default=None, help="threads per process (default: cores / nproc)"
    )
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="before each run, wait until the 1-minute load average is below this",
    )
    parser.add_argument("--output", type=Path, default=None, help="write the markdown report here")
    args, overrides = parser.parse_known_args(argv)
    preset = PRESETS.get(args.preset)
    args.config = args.config or (preset.config if preset else "train_configs/debug_model.toml")
    args.steps = args.steps or (preset.steps if preset else 40)
    args.warmup = args.warmup if args.warmup is not None else (preset.warmup if preset else 10)
    if args.steps - PROFILED_STEPS <= args.warmup:
        parser.error(f"--steps must exceed --warmup + {PROFILED_STEPS} (the profiled steps)")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    return args, overrides


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="benchmark_") as tmp:
        if args.preset:
            overrides = [
                *preset_overrides(PRESETS[args.preset], args.nproc, Path(tmp) / "corpus.json"),
                *overrides,
            ]
        precision = precision_case(args.config, overrides)
        print(f"precision: {precision}", flush=True)
        for repeat in range(args.repeats):
            folder = Path(tmp) / f"repeat_{repeat}"
            wait_for_quiet(args.max_load)
            trainer = run_trainer(args, overrides, folder / "trainer")
            trainer.load = os.getloadavg()[0]
            wait_for_quiet(args.max_load)
            bare = run_bare_loop(args, overrides, folder)
            bare.load = os.getloadavg()[0]
            print(
                f"repeat {repeat + 1}: trainer {trainer.median_step * 1e3:.1f} ms, "
                f"bare loop {bare.median_step * 1e3:.1f} ms",
                flush=True,
            )
            runs.append((trainer, bare))
    text = report(args, argv, runs, precision)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)


if __name__ == "__main__":
    main()
