"""The step-time model on this CPU: measured inputs, two fitted shares, three checked layouts.

The model of ``--time`` (``torchtitan/estimate/step_time.py``) is fed with what this machine
measures: the fp32 matmul peak of a process while as many processes compute as the row keeps
busy (2 threads for one, 1 each for two, as torchrun sets them), and gloo's all-gather +
reduce-scatter bus bandwidth and small-message latency between two processes; communication
takes the cores that compute (no overlap on a CPU). The achieved share of the peak is fitted
once per number of busy processes, on runs without communication: the 1-process run of
``train_configs/debug_model.toml``, and two such jobs run at once (two cores share memory
bandwidth, which a matmul peak does not show). FSDP 2, TP 2 and PP 2 (1F1B, 8 micro-batches)
are then predicted and measured (median step time of steps 6..N over interleaved rounds)::

    python scripts/estimate/cpu_step_time.py [--steps 25] [--rounds 3] [--output FILE.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.estimate.build import TrainingBuild  # noqa: E402
from torchtitan.estimate.step_time import DeviceKind, Efficiency, step_time  # noqa: E402
from torchtitan.estimate.time_mode import step_inputs  # noqa: E402
from torchtitan.tools.peaks import measure_matmul_flops  # noqa: E402

CONFIG = REPO / "train_configs" / "debug_model.toml"


@dataclass(frozen=True)
class Row:
    processes: int  # per job
    overrides: tuple[str, ...] = ()
    jobs: int = 1  # independent jobs run at once, each of `processes`
    fits: bool = False  # its measured step fits the compute share of its process count

    @property
    def busy_processes(self) -> int:
        return self.processes * self.jobs


ROWS = {
    "1 process": Row(1, fits=True),
    "2 apart": Row(1, jobs=2, fits=True),
    "FSDP 2": Row(2),
    "TP 2": Row(2, ("--parallelism.tensor_parallel_degree", "2")),
    "PP 2 (1F1B)": Row(2, ("--parallelism.pipeline_parallel_degree", "2")),
}
MESSAGE_BYTES = 2**20  # what each rank contributes: the debug model's TP activations are ~1 MiB


def _peak_worker(rank: int, threads: int, barrier, results: dict) -> None:
    torch.set_num_threads(threads)
    barrier.wait()
    results[rank] = measure_matmul_flops(torch.float32, repeats=40)


def matmul_peak(nproc: int) -> float:
    """fp32 matmul FLOP/s of one of ``nproc`` processes computing at once, each with its share
    of the cores (as torchrun sets them): a core's peak alone overstates what it does while
    its neighbour computes too (shared cache, memory bandwidth and clock)."""
    with mp.Manager() as manager:
        barrier, results = manager.Barrier(nproc), manager.dict()
        threads = max(1, (os.cpu_count() or 1) // nproc)
        mp.spawn(_peak_worker, args=(threads, barrier, results), nprocs=nproc)
        return statistics.mean(results.values())


def _gloo_worker(rank: int, store_file: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    shard = torch.ones(MESSAGE_BYTES // 4)
    gathered = torch.empty(2 * shard.numel())
    tiny, tiny_out = torch.ones(1), torch.empty(2)

    def seconds(action, repeats: int = 30) -> float:
        for _ in range(3):
            action()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            action()
        return (time.perf_counter() - start) / repeats

    def gather_and_reduce() -> None:
        dist.all_gather_into_tensor(gathered, shard)
        dist.reduce_scatter_tensor(shard, gathered)

    latency = seconds(lambda: dist.all_gather_into_tensor(tiny_out, tiny))
    pair = seconds(gather_and_reduce)
    if rank == 0:
        results["latency"] = latency
        # each collective sends one shard per rank; the pair's fixed latencies taken out
        results["bandwidth"] = 2 * MESSAGE_BYTES / max(pair - 2 * latency, 1e-9)
    dist.destroy_process_group()


def gloo_link() -> tuple[float, float]:
    """(bus bytes/s, seconds of latency) of gloo between two processes of this machine."""
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_gloo_worker, args=(os.path.join(folder, "store"), results), nprocs=2)
        return results["bandwidth"], results["latency"]


def measured_steps(row: Row, steps: int, folder: Path) -> list[float]:
    """Step times after warm-up of ``row``'s jobs, run at once (each with its own port and
    its share of the cores, as torchrun gives its processes)."""
    runs = []
    for job in range(row.jobs):
        job_folder = folder / str(job)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]
        cmd += [str(row.processes), "--master_port", str(29600 + job), "-m", "torchtitan.train"]
        cmd += job_args(list(row.overrides), steps, job_folder)
        threads = str(max(1, (os.cpu_count() or 1) // row.busy_processes))
        env = {**os.environ, "TORCHTITAN_CACHE": str(folder / "cache"), "OMP_NUM_THREADS": threads}
        runs.append(
            (
                job_folder,
                subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
                ),
            )
        )
    times = []
    for job_folder, run in runs:
        _, stderr = run.communicate()
        if run.returncode:
            raise RuntimeError(f"training run failed: {stderr.decode()[-2000:]}")
        lines = (job_folder / "metrics.jsonl").read_text().splitlines()
        times += [r["step_time"] for r in map(json.loads, lines) if r["step"] > 5]
    return times


def job_args(overrides: list[str], steps: int, folder: Path) -> list[str]:
    return [
        "--job.config_file", str(CONFIG), "--training.steps", str(steps),
        "--metrics.log_freq", "1", "--job.dump_folder", str(folder),
    ] + overrides  # fmt: skip


def predicted_step(row: Row, device: DeviceKind, efficiency: Efficiency) -> float:
    args = job_args(list(row.overrides), 1, Path(tempfile.gettempdir()))
    args += ["--memory_estimation.world_size", str(row.processes)]
    config = ConfigManager().parse_args(args)
    build = TrainingBuild(config, row.processes, "cpu").resolved_for("cpu")
    x = step_inputs(build, build.parallel_dims(), device)
    return step_time(dataclasses.replace(x, gpus_per_node=2, efficiency=efficiency)).total


def cpu_efficiency(share: float) -> Efficiency:
    """One share of the matmul peak for every kernel; the bandwidth is measured as achieved."""
    return Efficiency(
        matmul=share,
        float8_matmul=share,
        attention=share,
        eager_slowdown=1.0,
        collective=1.0,
        async_tp_hidden=0.0,
    )


def fit_share(measured: float, predict) -> float:
    low, high = 1e-3, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        if predict(middle) > measured:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each layout")
    parser.add_argument("--output", type=Path, help="write the report (markdown) here too")
    args = parser.parse_args()
    if args.steps < 7:
        parser.error("--steps: at least 7 (steps 1-5 warm up and are not timed)")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    peaks = {nproc: matmul_peak(nproc) for nproc in (1, 2)}
    bandwidth, latency = gloo_link()

    def device(row: Row) -> DeviceKind:
        busy = row.busy_processes
        return DeviceKind(f"this CPU, {busy} busy", peaks[busy], None, bandwidth, latency, False)

    steps: dict[str, list[float]] = {name: [] for name in ROWS}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):  # interleaved: a slow spell hits every row
            for name, row in ROWS.items():
                run_folder = Path(folder) / f"{name} {round_index}"
                steps[name] += measured_steps(row, args.steps, run_folder)
    measured = {name: statistics.median(times) for name, times in steps.items()}
    shares = {
        row.busy_processes: fit_share(
            measured[name], lambda s, row=row: predicted_step(row, device(row), cpu_efficiency(s))
        )
        for name, row in ROWS.items()
        if row.fits
    }
    lines = [
        "# Step-time model on this CPU",
        "",
        f"- command: `python scripts/estimate/cpu_step_time.py --steps {args.steps} "
        f"--rounds {args.rounds}`",
        f"- torch {torch.__version__}, Python {platform.python_version()}; "
        f"{os.cpu_count()} cores; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- measured: fp32 matmul peak {peaks[1] / 1e9:.1f} GFLOP/s for one process "
        f"(2 threads), {peaks[2] / 1e9:.1f} for each of two computing at once; "
        f"gloo between 2 processes {bandwidth / 1e9:.2f} GB/s bus "
        f"bandwidth ({MESSAGE_BYTES >> 20} MiB per rank, all-gather + reduce-scatter), "
        f"{latency * 1e3:.2f} ms latency",
        f"- fitted: the share of the matmul peak that one busy process achieves, "
        f"{shares[1]:.3f}, on the 1-process run; the share each of two busy processes "
        f"achieves, {shares[2]:.3f}, on two 1-process jobs run at once (no communication)",
        "",
        "| row | processes | predicted step (s) | measured median step (s) | error | role |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, row in ROWS.items():
        share = shares[row.busy_processes]
        predicted = predicted_step(row, device(row), cpu_efficiency(share))
        error = (predicted - measured[name]) / measured[name]
        role = "fit" if row.fits else "check"
        lines.append(
            f"| {name} | {row.busy_processes} | {predicted:.3f} | {measured[name]:.3f} "
            f"| {error:+.1%} | {role} |"
        )
    print("\n".join(lines))
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
