"""What the estimator covers, and the settings every mode resolves the same way."""

from __future__ import annotations

import dataclasses
import os

from torchtitan.components.adapters.lora import LORA
from torchtitan.components.quantization import FLOAT8_LINEAR
from torchtitan.config import (
    CompileConfig,
    ConfigError,
    MemoryEstimationConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.estimate.build import TrainingBuild
from torchtitan.estimate.pipeline_replay import SPLIT_BACKWARD_GAP

SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

COVERED = (
    "FSDP, HSDP, DDP, tensor parallel (with sequence and loss parallel), context parallel, "
    "pipeline parallel (1F1B, GPipe, Interleaved1F1B, LoopedBFS), expert parallel "
    "(balanced routing), activation checkpointing, LoRA (mode plan: not yet), QLoRA (mode "
    "plan: not yet), float8 linears (traced; not in closed form)"
)


def resolve_world_size(memory_estimation: MemoryEstimationConfig) -> int:
    configured = memory_estimation.world_size
    if configured is not None:
        return configured
    if "NGPU" in os.environ:
        return int(os.environ["NGPU"]) * int(os.environ.get("NNODES", "1"))
    raise ConfigError(
        "memory_estimation.world_size: not set; pass --memory_estimation.world_size N "
        "(or set NGPU and NNODES)"
    )


def converters_gap(converters: list[str]) -> str | None:
    """The converters the estimator does not model (LoRA and float8 linears it traces)."""
    if not [name for name in converters if name != LORA and name not in FLOAT8_LINEAR]:
        return None
    return (
        f"model.converters={converters}: MX training and float8 / MX grouped GEMMs (their "
        "weights and all-gather buffers)"
    )


def coverage_gap(
    converters: list[str],
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    parallel_dims: ParallelDims,
) -> str | None:
    """Why the estimator cannot trace this run, or None."""
    gap = converters_gap(converters)
    if gap:
        return gap
    if (
        parallel_dims.pp_enabled
        and parallelism.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES
    ):
        schedule = parallelism.pipeline_parallel_schedule
        return f"parallelism.pipeline_parallel_schedule={schedule}: {SPLIT_BACKWARD_GAP}"
    if parallelism.enable_async_tensor_parallel:
        return "parallelism.enable_async_tensor_parallel: async tensor parallel"
    if training.enable_cpu_offload:
        return "training.enable_cpu_offload: CPU offload"
    return None


def activation_checkpoint_gap(mode: str) -> str | None:
    """The trace runs eager, where memory-budget AC (the compiler's) keeps everything."""
    if mode == "memory_budget":
        return (
            "activation_checkpoint.mode='memory_budget': the compiled blocks' min-cut (the trace "
            "runs eager); memory_estimation.mode measure runs it"
        )
    return None


def check_covered(build: TrainingBuild) -> ParallelDims:
    """The trainer's checks for the target device (never this host's; a GPU of unknown
    kind), then what the estimator covers; the ParallelDims of a CPU mesh to trace on."""
    config = build.config
    gap = converters_gap(config.model.converters)
    parallel_dims = None if gap else build.parallel_dims()
    gap = (
        gap
        or activation_checkpoint_gap(config.activation_checkpoint.mode)
        or coverage_gap(config.model.converters, config.parallelism, config.training, parallel_dims)
    )
    if gap is not None:
        raise ConfigError(f"{gap} is not covered by the memory estimator yet (covered: {COVERED})")
    return parallel_dims


def eager(compile_config: CompileConfig) -> CompileConfig:
    """Tracing runs eagerly: compile is turned off, with a notice (compiled runs usually
    need somewhat less memory)."""
    if not compile_config.enable:
        return compile_config
    print(
        "note: compile.enable is ignored: the estimate traces eager mode (compiled runs "
        "usually need somewhat less activation memory)"
    )
    return dataclasses.replace(compile_config, enable=False)
