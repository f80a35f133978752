"""The traced estimate: the training steps of one rank on fake CPU tensors under a fake
process group, tracked per allocation."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from torchtitan.config import ConfigError, JobConfig
from torchtitan.estimate.build import TrainingSetup, build_parallelized_meta_model, materialize_setup
from torchtitan.estimate.coverage import check_covered
from torchtitan.estimate.steps import run_training_steps
from torchtitan.estimate.tracker import TrackerResult, build_tracker
from torchtitan.estimate.tracing import (
    cuda_block_rounding,
    cuda_kernel_emulation,
    fake_process_group,
    private_propagation_fake_mode,
)


@dataclass
class TraceOutcome:
    result: TrackerResult
    seconds: float
    setup: TrainingSetup


def target_device_context(target: str) -> contextlib.ExitStack:
    """For target cuda: the caching allocator's block rounding and the CUDA kernels'
    saved tensors. For target cpu: nothing (trace what a CPU run allocates)."""
    stack = contextlib.ExitStack()
    if target == "cuda":
        stack.enter_context(cuda_block_rounding())
        stack.enter_context(cuda_kernel_emulation())
    return stack


def trace_training_memory(job_config: JobConfig, world_size: int, target: str) -> TraceOutcome:
    """Peak memory of rank 0 (the rank with the largest share: FSDP pads every shard to the
    first rank's size) over two training steps."""
    start = time.perf_counter()
    parallel_dims = check_covered(job_config, world_size)
    with fake_process_group(world_size), private_propagation_fake_mode():
        parallel_dims.world_mesh  # noqa: B018  (meshes are built outside fake mode)
        spec, model_args, model = build_parallelized_meta_model(job_config, parallel_dims)
        with FakeTensorMode(allow_non_fake_inputs=True):
            setup = materialize_setup(
                job_config, parallel_dims, torch.device("cpu"), spec, model_args, model, init_seed=None
            )
            tracker = build_tracker(setup.model, list(setup.optimizers))
            try:
                with target_device_context(target), tracker:
                    run_training_steps(setup, tracker)
            except DataDependentOutputException as e:
                raise ConfigError(
                    f"model.name={job_config.model.name!r}: the model has data-dependent shapes "
                    f"({e.func}, e.g. MoE token routing), which fake tensors cannot trace; not "
                    "covered by the memory estimator yet"
                ) from None
    return TraceOutcome(tracker.result(), time.perf_counter() - start, setup)
