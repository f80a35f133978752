"""What the estimator builds as the trainer does (``torchtitan/recipe.py``): one configured
run on ``world_size`` ranks of a target device, its checks, ParallelDims for a mesh of a
chosen device type, model args that keep the flavor's vocabulary, and the recipe."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.preflight import preflight
from torchtitan.protocols import get_train_spec
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.recipe import (
    MetaModel,
    Recipe,
    build_meta_model,
    materialize,
    model_args_from_config,
    resolve_for_device,
)


@dataclass(frozen=True)
class TrainingBuild:
    """A configured training run on ``world_size`` ranks of ``target`` ("cuda": a GPU whose
    kind is not known), built as the trainer builds it. The trainer's checks, model args and
    recipe read the whole config, so this is what the estimator hands to what builds (the
    trace, the measured run, the coverage checks) and ships to a fresh process; the rest of
    the estimator takes config sections."""

    config: JobConfig
    world_size: int
    target: str

    def resolved_for(self, device_type: str) -> TrainingBuild:
        """This build with a copy of its config resolved for a run on ``device_type`` (the
        CPU's precision, fused kernels). A copy: one config can be built for several targets,
        and a GPU target must not see what the CPU resolved."""
        config = copy.deepcopy(self.config)
        resolve_for_device(config, device_type)
        return replace(self, config=config)

    def parallel_dims(self, device_type: str = "cpu") -> ParallelDims:
        """The trainer's preflight checks for a run on ``target``, then ParallelDims whose
        mesh will be of ``device_type``."""
        parallel_dims = preflight(self.config, self.world_size, self.target)
        parallel_dims.device_type = device_type
        return parallel_dims

    def model_args(self) -> BaseModelArgs:
        """The flavor's args updated from the config. Without ``model.tokenizer_path`` the
        flavor's vocabulary is kept (the trainer's built-in byte tokenizer would shrink it)."""
        spec = get_train_spec(self.config.model.name)
        tokenizer = None
        if self.config.model.tokenizer_path and spec.build_tokenizer_fn is not None:
            tokenizer = spec.build_tokenizer_fn(self.config.model)
        return model_args_from_config(spec, self.config, tokenizer)

    def meta_model(self, parallel_dims: ParallelDims, device: torch.device) -> MetaModel:
        spec = get_train_spec(self.config.model.name)
        return build_meta_model(self.config, parallel_dims, spec, self.model_args(), device)

    def materialize(
        self,
        meta: MetaModel,
        parallel_dims: ParallelDims,
        device: torch.device,
        *,
        seed: int | None,
    ) -> Recipe:
        """The recipe as its first step sees it: under QLoRA with the base made NF4 (the
        trainer fills it from the loaded base, which the estimator skips)."""
        recipe = materialize(meta, self.config, parallel_dims, device, seed=seed)
        if recipe.pending_base is not None:
            recipe.pending_base.fill(None)
        return recipe

    def recipe(self, parallel_dims: ParallelDims, device: torch.device, *, seed: int) -> Recipe:
        """The whole build on real tensors."""
        meta = self.meta_model(parallel_dims, device)
        return self.materialize(meta, parallel_dims, device, seed=seed)
