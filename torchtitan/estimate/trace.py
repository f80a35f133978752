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

from torchtitan.config import ConfigError, ConfigManager, config_to_toml
from torchtitan.estimate.build import TrainingBuild
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
from torchtitan.recipe import Recipe

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


def trace_training_memory(build: TrainingBuild) -> TraceOutcome:
    """Peak memory over two training steps of the rank with the largest share: rank 0 (FSDP
    pads every shard to the first rank's size), under pipeline parallel the first rank of
    every pipeline rank (each holds different stages), the largest reported."""
    start = time.perf_counter()
    build = build.resolved_for(build.target)
    parallel_dims = check_covered(build)
    if not parallel_dims.pp_enabled:
        result, setup = _trace_rank(build, rank=0)
        return TraceOutcome(result, time.perf_counter() - start, setup)
    first, setup = _trace_rank(build, rank=0)
    stage_ranks = [
        parallel_dims.first_rank_at("pp", pp_rank) for pp_rank in range(1, parallel_dims.pp)
    ]
    results = [first] + [in_fresh_process(_traced_rank_result, build, rank) for rank in stage_ranks]
    result = max(results, key=lambda r: r.peak_bytes)
    return TraceOutcome(result, time.perf_counter() - start, setup, [r.peak_bytes for r in results])


def in_fresh_process(fn: Callable[..., T], build: TrainingBuild, *args: Any) -> T:
    """``fn(build, *args)`` in a new process, the config shipped as TOML. Traces of
    different ranks or worlds must not share one: DTensor's caches are keyed by meshes that
    compare equal across process groups and would hand one world's groups to the other."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "job.toml")
        with open(path, "w") as f:
            f.write(config_to_toml(build.config))
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            shipped = (path, build.world_size, build.target)
            return pool.submit(_call_with_build, fn, *shipped, *args).result()


def _call_with_build(
    fn: Callable[..., T], config_path: str, world_size: int, target: str, *args: Any
) -> T:
    config = ConfigManager().parse_args(["--job.config_file", config_path])
    return fn(TrainingBuild(config, world_size, target), *args)


def _traced_rank_result(build: TrainingBuild, rank: int) -> TrackerResult:
    return _trace_rank(build, rank)[0]


def _trace_rank(build: TrainingBuild, rank: int) -> tuple[TrackerResult, Recipe]:
    parallel_dims = check_covered(build)
    device = torch.device("cpu")
    with (
        fake_process_group(build.world_size, rank),
        private_propagation_fake_mode(),
        balanced_moe_routing(build.target),
        ddp_bucket_allocations(),
    ):
        parallel_dims.world_mesh  # noqa: B018  (meshes are built outside fake mode)
        meta = build.meta_model(parallel_dims, device)
        with FakeTensorMode(allow_non_fake_inputs=True):
            setup = build.materialize(meta, parallel_dims, device, seed=None)
            tracker = build_tracker(setup.model_parts, list(setup.optimizers))
            try:
                with target_device_context(build.target), tracker, warnings.catch_warnings():
                    # torchao's NF4 all-gather compares storage pointers, of fake tensors here
                    warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
                    run_training_steps(setup, tracker, replay_pipeline=True)
            except DataDependentOutputException as e:
                raise ConfigError(
                    f"model.name={build.config.model.name!r}: the model has data-dependent "
                    f"shapes ({e.func}), which fake tensors cannot trace; not covered by the "
                    "memory estimator yet"
                ) from None
    return tracker.result(), setup
