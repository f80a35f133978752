"""``--time``: the step-time model (``step_time``) fed by the configured run, as the memory
estimate is: the same layout, activation checkpointing, compile, float8, CP rotation and
pipeline schedule the trainer would run, on ``memory_estimation.gpu`` GPUs."""

from __future__ import annotations

from torchtitan.components.quantization import FLOAT8_LINEAR
from torchtitan.config import ConfigError, JobConfig, MemoryEstimationConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.data_parallel import reshard_after_forward_policy
from torchtitan.distributed.pipeline import microbatches, plan_stages
from torchtitan.estimate.build import TrainingBuild
from torchtitan.estimate.closed_form.from_config import closed_form_inputs
from torchtitan.estimate.step_time import (
    GPU_KINDS,
    DeviceKind,
    StepInputs,
    StepTime,
    step_time,
)
from torchtitan.protocols.geometry import Geometry
from torchtitan.recipe import grad_accumulation_steps


def step_inputs(
    build: TrainingBuild, parallel_dims: ParallelDims, device: DeviceKind | None = None
) -> StepInputs:
    """The step-time model's view of the configured run (checked as the trainer checks it),
    on ``memory_estimation.gpu`` GPUs unless ``device`` is given."""
    config = build.config
    me, p, t = config.memory_estimation, config.parallelism, config.training
    accum = grad_accumulation_steps(t, parallel_dims)
    geometry, layout, run = closed_form_inputs(
        build.model_args(),
        parallel_dims,
        accum,
        build.target,
        training=t,
        optimizer=config.optimizer,
        parallelism=p,
        activation_checkpoint=config.activation_checkpoint,
        model=config.model,
        lora=config.lora,
    )
    _check_timeable(geometry, config)
    stages_per_rank, pp_microbatches = 1, 1
    if parallel_dims.pp > 1:
        stages = plan_stages(p, geometry.n_layers, parallel_dims.pp).num_stages
        stages_per_rank = stages // parallel_dims.pp
        pp_microbatches = microbatches(p, t.local_batch_size, stages)
    float8 = any(name in FLOAT8_LINEAR for name in config.model.converters)
    return StepInputs(
        geometry=geometry,
        layout=layout,
        seq_len=t.seq_len,
        local_batch=t.local_batch_size,
        grad_accum=accum,
        param_bytes=run.param_bytes,
        reduce_bytes=4 if t.mixed_precision_reduce == "float32" else 2,
        compile=config.compile.enable,
        float8=float8,
        float8_all_gather=float8 and config.quantize.linear.float8.enable_fsdp_float8_all_gather,
        async_tp=p.enable_async_tensor_parallel,
        reshard_after_forward=reshard_after_forward_policy(
            p.fsdp_reshard_after_forward, parallel_dims.pp > 1
        ),
        cp_ring=parallel_dims.ring_cp,
        pp_schedule=p.pipeline_parallel_schedule,
        pp_microbatches=pp_microbatches,
        stages_per_rank=stages_per_rank,
        device=device or GPU_KINDS[me.gpu],
        gpus_per_node=me.gpus_per_node,
        network_bytes_per_s=me.network_gbps_per_gpu * 1e9 / 8,
    )


def _check_timeable(geometry: Geometry | None, config: JobConfig) -> None:
    model = config.model
    if geometry is None or geometry.mla is not None or geometry.delta_rule is not None:
        raise ConfigError(
            f"model.name: the step-time model covers attention decoders, dense or MoE (no "
            f"latent attention or Gated DeltaNet yet); {model.name!r} {model.flavor!r} is not "
            "one; drop --time"
        )
    check_gpu_kind(config.memory_estimation, model.converters)


def check_gpu_kind(me: MemoryEstimationConfig, converters: list[str]) -> None:
    """Float8 linears need a GPU kind with float8 matmuls."""
    if any(name in FLOAT8_LINEAR for name in converters) and GPU_KINDS[me.gpu].fp8_flops is None:
        raise ConfigError(
            f"memory_estimation.gpu: {me.gpu} has no float8 matmuls; choose H100, H200 or "
            "B200, or drop the float8 converter"
        )


def predict(build: TrainingBuild, parallel_dims: ParallelDims) -> StepTime:
    return step_time(step_inputs(build, parallel_dims))


def time_lines(build: TrainingBuild, parallel_dims: ParallelDims) -> list[str]:
    """The predicted step of the configured run: tokens/s per GPU, MFU and the breakdown."""
    inputs = step_inputs(build, parallel_dims)
    predicted = step_time(inputs)
    return [
        f"step time on {inputs.device.name} ({inputs.gpus_per_node} per node, "
        f"{build.config.memory_estimation.network_gbps_per_gpu:g} Gb/s per GPU between nodes; "
        "model calibrated on published H100 runs, benchmarks/step_time_calibration.md):",
        f"  {predicted.total:.3f} s per step, {predicted.tokens_per_second_per_gpu:,.0f} tokens/s "
        f"per GPU, MFU {predicted.mfu:.1%}",
    ] + predicted.lines()
