"""What the estimator builds beyond the recipe (``torchtitan/recipe.py``): ParallelDims for
a mesh of a chosen device type, and model args that keep the flavor's vocabulary."""

from __future__ import annotations

import torch

from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.preflight import preflight
from torchtitan.protocols import TrainSpec, get_train_spec
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.recipe import (
    MetaModel,
    Recipe,
    build_meta_model,
    materialize,
    model_args_from_config,
)


def build_parallel_dims(
    job_config: JobConfig, world_size: int, device_type: str, target: str | None = None
) -> ParallelDims:
    """The trainer's preflight checks for a run on ``target`` (default ``device_type``; a GPU
    whose kind is not known), then ParallelDims whose mesh will be of ``device_type``."""
    parallel_dims = preflight(job_config, world_size, target or device_type)
    parallel_dims.device_type = device_type
    return parallel_dims


def estimation_model_args(job_config: JobConfig, spec: TrainSpec) -> BaseModelArgs:
    """The flavor's args updated from the config. Without ``model.tokenizer_path`` the
    flavor's vocabulary is kept (the trainer's built-in byte tokenizer would shrink it)."""
    tokenizer = None
    if job_config.model.tokenizer_path and spec.build_tokenizer_fn is not None:
        tokenizer = spec.build_tokenizer_fn(job_config.model)
    return model_args_from_config(spec, job_config, tokenizer)


def build_estimation_meta_model(
    job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device
) -> MetaModel:
    spec = get_train_spec(job_config.model.name)
    return build_meta_model(
        job_config, parallel_dims, spec, estimation_model_args(job_config, spec), device
    )


def materialize_as_trained(
    meta: MetaModel,
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    device: torch.device,
    *,
    seed: int | None,
) -> Recipe:
    """The recipe as its first step sees it: under QLoRA with the base made NF4 (the trainer
    fills it from the loaded base, which the estimator skips)."""
    recipe = materialize(meta, job_config, parallel_dims, device, seed=seed)
    if recipe.pending_base is not None:
        recipe.pending_base.fill(None)
    return recipe


def build_estimation_recipe(
    job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device, *, seed: int | None
) -> Recipe:
    meta = build_estimation_meta_model(job_config, parallel_dims, device)
    return materialize_as_trained(meta, job_config, parallel_dims, device, seed=seed)
