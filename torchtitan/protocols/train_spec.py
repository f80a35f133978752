"""Train specs: everything the trainer needs to train one model family, registered by name.

Builders that need ranks or meshes take ``parallel_dims`` and read
``parallel_dims.world_mesh[...]`` themselves; no mesh or rank is passed in.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn

from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

if TYPE_CHECKING:
    pass

# parallelize_fn(model, parallel_dims, *, training, parallelism, activation_checkpoint,
#                compile_config) -> model: applies TP, CP, EP, AC, compile, FSDP/DDP in place
#                (the recipe's ``parallelize_settings`` gives the keyword arguments)
ParallelizeFunction: TypeAlias = Callable[..., nn.Module]
# pipelining_fn(model, parallel_dims, parallelism, local_batch_size, device, parallelize, loss_fn)
#   -> BuiltPipeline (torchtitan.distributed.pipeline): schedule, stages, model_parts,
#      has_first_stage, has_last_stage; ``parallelize(stage) -> stage`` is the spec's
#      parallelize_fn with the run's settings
PipeliningFunction: TypeAlias = Callable[..., Any]
# build_optimizers_fn(model_parts, optimizer: OptimizerConfig, parallel_dims) -> OptimizersContainer
OptimizersBuilder: TypeAlias = Callable[..., Any]
# build_lr_schedulers_fn(optimizers, lr_scheduler: LRSchedulerConfig, training_steps: int)
#   -> LRSchedulersContainer
LRSchedulersBuilder: TypeAlias = Callable[..., Any]
# build_dataloader_fn(data: TrainingConfig | ValidationConfig, parallel_dims, tokenizer,
#                     split="train") -> data loader of that section's data set
DataLoaderBuilder: TypeAlias = Callable[..., Any]
# build_tokenizer_fn(model: ModelConfig) -> BaseTokenizer
TokenizerBuilder: TypeAlias = Callable[..., Any]
# build_loss_fn() -> loss_fn(pred, labels) -> scalar tensor: the SUM of the per-token losses
# over labels != IGNORE_INDEX (the recipe divides by the global batch's valid tokens)
LossFunctionBuilder: TypeAlias = Callable[[], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
# build_validator_fn(*, validation: ValidationConfig, reset_positions, parallel_dims, tokenizer,
#                    loss_fn, train_context, metrics_processor, pipeline) -> Validator
ValidatorBuilder: TypeAlias = Callable[..., Any]


@dataclass
class TrainSpec:
    name: str
    model_cls: type[nn.Module]
    model_args: dict[str, BaseModelArgs]
    parallelize_fn: ParallelizeFunction
    pipelining_fn: PipeliningFunction | None
    build_optimizers_fn: OptimizersBuilder
    build_lr_schedulers_fn: LRSchedulersBuilder
    build_dataloader_fn: DataLoaderBuilder
    build_tokenizer_fn: TokenizerBuilder | None
    build_loss_fn: LossFunctionBuilder
    build_validator_fn: ValidatorBuilder | None = None
    state_dict_adapter: type[StateDictAdapter] | None = None

    def flavor_args(self, flavor: str) -> BaseModelArgs:
        """A fresh copy of the named flavor's args (unknown flavor: error listing them)."""
        if flavor not in self.model_args:
            hint = difflib.get_close_matches(flavor, self.model_args, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ValueError(
                f"model.flavor: unknown flavor {flavor!r} for model {self.name!r}{suggestion}; "
                f"available: {', '.join(self.model_args)}"
            )
        return replace(self.model_args[flavor])

    def hf_adapter(
        self, model_args: BaseModelArgs, hf_assets_path: str | None = None
    ) -> StateDictAdapter | None:
        """The model's Hugging Face state-dict adapter for these args (None: it has none)."""
        if self.state_dict_adapter is None:
            return None
        return self.state_dict_adapter(model_args, hf_assets_path)


_train_specs: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    if spec.name in _train_specs:
        raise ValueError(f"a train spec named {spec.name!r} is already registered")
    _train_specs[spec.name] = spec


def get_train_spec(name: str) -> TrainSpec:
    _import_builtin_models()
    if name not in _train_specs:
        hint = difflib.get_close_matches(name, _train_specs, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ValueError(
            f"model.name: unknown model {name!r}{suggestion}; registered: "
            f"{', '.join(sorted(_train_specs))}. Register your own with "
            "--experimental.custom_import your.module"
        )
    return _train_specs[name]


def apply_to_train_specs(fn: Callable[[TrainSpec], TrainSpec]) -> None:
    """Rewrite every registered spec, e.g. to wrap ``build_optimizers_fn``."""
    _import_builtin_models()
    for name, spec in list(_train_specs.items()):
        _train_specs[name] = fn(spec)


def _import_builtin_models() -> None:
    # Imported lazily so that the config tooling does not pay for model imports.
    from torchtitan.models import register_builtin_models

    register_builtin_models()
