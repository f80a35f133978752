"""The traced estimate: the training steps of one rank on fake CPU tensors under a fake
process group, tracked per allocation."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from torchtitan.config import ConfigError, ConfigManager, JobConfig, config_to_toml
from torchtitan.estimate.build import build_estimation_meta_model, materialize_as_trained
from torchtitan.estimate.coverage import check_covered
from torchtitan.estimate.emulation import (
    balanced_moe_routing,
    cuda_block_rounding,
    cuda_kernel_emulation,
    ddp_bucket_allocations,
    fake_process_group,
    private_propagation_fake_mode,
)
from torchtitan.estimate.memory_tracker import TrackerResult, build_tracker
from torchtitan.estimate.steps import run_training_steps
from torchtitan.recipe import Recipe, resolve_for_device

T = TypeVar("T")


@dataclass
class TraceOutcome:
    result: TrackerResult
    """The traced rank's peak; under pipeline parallel the pipeline rank with the largest."""
    seconds: float
    setup: Recipe
    stage_peaks: list[int] | None = None
    """Under pipeline parallel: the peak of each pipeline rank, by pp rank."""

    @property
    def pp_rank(self) -> int | None:
        if self.stage_peaks is None:
            return None
        return self.stage_peaks.index(self.result.peak_bytes)


def target_device_context(target: str) -> contextlib.ExitStack:
    """For target cuda: the caching allocator's block rounding and the CUDA kernels'
    saved tensors. For target cpu: nothing (trace what a CPU run allocates)."""
    stack = contextlib.ExitStack()
    if target == "cuda":
        stack.enter_context(cuda_block_rounding())
        stack.enter_context(cuda_kernel_emulation())
    return stack


def trace_training_memory(job_config: JobConfig, world_size: int, target: str) -> TraceOutcome:
    """Peak memory over two training steps of the rank with the largest share: rank 0 (FSDP
    pads every shard to the first rank's size), under pipeline parallel the first rank of
    every pipeline rank (each holds different stages), the largest reported."""
    start = time.perf_counter()
    resolve_for_device(job_config, target)
    parallel_dims = check_covered(job_config, world_size)
    if not parallel_dims.pp_enabled:
        result, setup = _trace_rank(job_config, world_size, target, rank=0)
        return TraceOutcome(result, time.perf_counter() - start, setup)
    first, setup = _trace_rank(job_config, world_size, target, rank=0)
    stage_ranks = [
        parallel_dims.first_rank_at("pp", pp_rank) for pp_rank in range(1, parallel_dims.pp)
    ]
    results = [first] + [
        in_fresh_process(_traced_rank_result, job_config, world_size, target, rank)
        for rank in stage_ranks
    ]
    result = max(results, key=lambda r: r.peak_bytes)
    return TraceOutcome(result, time.perf_counter() - start, setup, [r.peak_bytes for r in results])


def in_fresh_process(fn: Callable[..., T], job_config: JobConfig, *args: Any) -> T:
    """``fn(job_config, *args)`` in a new process. Traces of different ranks or worlds
    must not share one: DTensor's caches are keyed by meshes that compare equal across
    process groups and would hand one world's groups to the other."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "job.toml")
        with open(path, "w") as f:
            f.write(config_to_toml(job_config))
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_call_with_config, fn, path, *args).result()


def _call_with_config(fn: Callable[..., T], config_path: str, *args: Any) -> T:
    return fn(ConfigManager().parse_args(["--job.config_file", config_path]), *args)


def _traced_rank_result(
    job_config: JobConfig, world_size: int, target: str, rank: int
) -> TrackerResult:
    return _trace_rank(job_config, world_size, target, rank)[0]


def _trace_rank(
    job_config: JobConfig, world_size: int, target: str, rank: int
) -> tuple[TrackerResult, Recipe]:
    parallel_dims = check_covered(job_config, world_size)
    device = torch.device("cpu")
    with (
        fake_process_group(world_size, rank),
        private_propagation_fake_mode(),
        balanced_moe_routing(target),
        ddp_bucket_allocations(),
    ):
        parallel_dims.world_mesh  # noqa: B018  (meshes are built outside fake mode)
        meta = build_estimation_meta_model(job_config, parallel_dims, device)
        with FakeTensorMode(allow_non_fake_inputs=True):
            setup = materialize_as_trained(meta, job_config, parallel_dims, device, seed=None)
            tracker = build_tracker(setup.model_parts, list(setup.optimizers))
            try:
                with target_device_context(target), tracker, warnings.catch_warnings():
                    # torchao's NF4 all-gather compares storage pointers, of fake tensors here
                    warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
                    run_training_steps(setup, tracker, replay_pipeline=True)
            except DataDependentOutputException as e:
                raise ConfigError(
                    f"model.name={job_config.model.name!r}: the model has data-dependent shapes "
                    f"({e.func}), which fake tensors cannot trace; not covered by the memory "
                    "estimator yet"
                ) from None
    return tracker.result(), setup
