"""``--memory_estimation.mode measure``: run the traced steps on real tensors, trace the
estimate, print both peaks. Under torchrun every rank runs for real (gloo on CPU, NCCL on
CUDA); otherwise one rank of ``world_size`` is emulated in this process on a fake process
group (collectives are no-ops, every buffer has its per-rank size).

The estimate is traced in a fresh process: DeviceMeshes of the fake and the real process
group compare equal, so DTensor's global caches would hand one world's process groups to
the other."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from torchtitan.config import ConfigError, JobConfig, ParallelismConfig
from torchtitan.distributed.parallel_dims import default_device_type
from torchtitan.distributed.process import init_distributed, leave_together
from torchtitan.estimate import report
from torchtitan.estimate.build import TrainingBuild
from torchtitan.estimate.coverage import check_covered, eager, resolve_world_size
from torchtitan.estimate.emulation import fake_process_group
from torchtitan.estimate.real_steps import MeasuredOutcome, measure_training_memory
from torchtitan.estimate.steps import ITERATIONS
from torchtitan.estimate.trace import in_fresh_process, trace_training_memory


def _measuring_device(target: str) -> torch.device:
    device_type = default_device_type()
    if device_type != target:
        raise ConfigError(
            f"memory_estimation.target_device={target!r} but real tensors here are on "
            f"{device_type}; pass --memory_estimation.target_device {device_type}"
        )
    if device_type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(device_type)


def measure_single_process(build: TrainingBuild) -> MeasuredOutcome:
    """One rank of ``build.world_size`` on real tensors: collectives are no-ops (fake process
    group) and every buffer has its per-rank size."""
    device = _measuring_device(build.target)
    _check_one_process(build.config.parallelism)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with fake_process_group(build.world_size):
        return measure_training_memory(build, device)


def _check_one_process(parallelism: ParallelismConfig) -> None:
    """Expert and pipeline parallel move real tensors between ranks: not in one process."""
    for field, what in (
        ("expert_parallel_degree", "route tokens between expert-parallel ranks"),
        ("pipeline_parallel_degree", "pass activations between pipeline stages"),
    ):
        if getattr(parallelism, field) > 1:
            raise ConfigError(
                f"parallelism.{field}: real tensors in one process cannot {what}; measure under "
                "torchrun (torchrun --nproc_per_node N scripts/estimate/estimation.py ... "
                "--memory_estimation.mode measure)"
            )


def _measure_distributed(build: TrainingBuild) -> list[MeasuredOutcome]:
    """Every rank of a torchrun launch measures itself; all outcomes are gathered."""
    config = build.config
    device = init_distributed(
        config.comm, config.job.dump_folder, config.training.enable_cpu_offload
    )
    mine = measure_training_memory(build, device)
    outcomes: list[MeasuredOutcome | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, mine)
    leave_together()
    return outcomes


def _traced_peaks(build: TrainingBuild) -> list[int]:
    outcome = trace_training_memory(build)
    return outcome.stage_peaks or [outcome.result.peak_bytes]


def traced_peaks_in_fresh_process(build: TrainingBuild) -> list[int]:
    """The traced peak of each pipeline rank (one entry without pipeline parallel)."""
    return in_fresh_process(_traced_peaks, build)


def run_measure(job_config: JobConfig) -> int:
    me = job_config.memory_estimation
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if launched else resolve_world_size(me)
    if launched and me.world_size not in (None, world_size):
        raise ConfigError(
            f"memory_estimation.world_size ({me.world_size}) differs from torchrun's WORLD_SIZE "
            f"({world_size}); drop it or launch that many processes"
        )
    job_config = dataclasses.replace(job_config, compile=eager(job_config.compile))
    build = TrainingBuild(job_config, world_size, me.target_device)
    check_covered(build)
    _measuring_device(me.target_device)
    if not launched:
        measured = [measure_single_process(build)]
        estimates = traced_peaks_in_fresh_process(build)
        print("\n".join(measure_lines(estimates, measured, world_size, launched)))
        return 0
    measured = _measure_distributed(build)
    if int(os.environ["RANK"]) == 0:
        estimates = traced_peaks_in_fresh_process(build)
        print("\n".join(measure_lines(estimates, measured, world_size, launched)))
    return 0


def measure_lines(
    estimates: list[int], measured: list[MeasuredOutcome], world_size: int, launched: bool
) -> list[str]:
    """``estimates``: the traced peak per pipeline rank (one entry without pipeline
    parallel); every measured rank is compared with its pipeline rank's."""
    how = (
        f"{len(measured)} real processes"
        if launched
        else f"rank 0 of {world_size} emulated in one process"
    )
    ranks_per_stage = world_size // len(estimates)
    lines = [f"measured: traced estimate vs measured peak over the same {ITERATIONS} steps ({how})"]
    for pp_rank, estimate in enumerate(estimates):
        whose = f"rank {pp_rank * ranks_per_stage} of {world_size}"
        if len(estimates) > 1:
            whose += f", pipeline rank {pp_rank}"
        lines.append(
            f"  estimate (fake tensors, {whose}): {estimate:,} B ({report.size(estimate)})"
        )
    for rank, m in enumerate(measured):
        estimate = estimates[rank // ranks_per_stage]
        parts = [f"{m.method} {m.peak_bytes:,} B (estimate {_error(estimate, m.peak_bytes)})"]
        if m.tracker is not None:
            parts.insert(
                0,
                f"tracker on real tensors {m.tracker.peak_bytes:,} B (estimate "
                f"{_error(estimate, m.tracker.peak_bytes)})",
            )
        if m.reserved_bytes is not None:
            parts.append(f"reserved {m.reserved_bytes:,} B")
        if m.replayed is not None:
            parts[0] = "schedule: " + parts[0]
            r = m.replayed
            parts.append(
                f"replayed schedule: tracker on real tensors {r.tracker.peak_bytes:,} B (estimate "
                f"{_error(estimate, r.tracker.peak_bytes)}), {r.method} {r.peak_bytes:,} B"
            )
        lines.append(f"  rank {rank}: " + "; ".join(parts))
    if any(m.reserved_bytes is not None for m in measured):
        lines.append(
            "  max_memory_allocated also counts cuBLAS workspaces "
            f"({report.CUBLAS_WORKSPACE_BYTES >> 20} MiB on sm90) that tracing cannot see; "
            "the estimate's device additions list them"
        )
    return lines


def _error(estimate: int, measured: int) -> str:
    return f"{(estimate - measured) / measured:+.2%}"
