"""Build what the trainer builds (train spec, model args, ParallelDims, parallelize_fn,
optimizers, LR schedulers, loss), on fake or real tensors, in the trainer's order."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.components.loss import rescale_accumulated_loss
from torchtitan.config import ConfigError, JobConfig
from torchtitan.config.preflight import preflight
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.data_parallel import TORCH_DTYPES
from torchtitan.distributed.pipeline import BuiltPipeline
from torchtitan.protocols import ModelConvertersContainer, TrainSpec, get_train_spec
from torchtitan.protocols.model import BaseModelArgs


@dataclass
class MetaBuild:
    """The parallelized model on meta: one part, or this rank's pipeline stages."""

    spec: TrainSpec
    model_args: BaseModelArgs
    model_parts: list[nn.Module]
    pipeline: BuiltPipeline | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    grad_accum_steps: int


@dataclass
class TrainingSetup:
    job_config: JobConfig
    spec: TrainSpec
    model_args: BaseModelArgs
    parallel_dims: ParallelDims
    model_parts: list[nn.Module]
    pipeline: BuiltPipeline | None
    optimizers: Any
    lr_schedulers: Any
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    grad_accum_steps: int
    train_context: Callable[[], contextlib.AbstractContextManager]
    device: torch.device

    @property
    def vocab_size(self) -> int:
        return self.model_args.vocab_size

    @property
    def model(self) -> nn.Module:
        """The whole model (without pipeline parallel)."""
        assert self.pipeline is None
        return self.model_parts[0]


def build_parallel_dims(job_config: JobConfig, world_size: int, device_type: str) -> ParallelDims:
    """The trainer's preflight checks, then ParallelDims whose mesh will be of ``device_type``."""
    parallel_dims = preflight(job_config, world_size, device_type)
    parallel_dims.device_type = device_type
    return parallel_dims


def estimation_model_args(job_config: JobConfig, spec: TrainSpec) -> BaseModelArgs:
    """The flavor's args updated from the config. Without ``model.tokenizer_path`` the
    flavor's vocabulary is kept (the trainer's built-in byte tokenizer would shrink it)."""
    try:
        model_args = spec.flavor_args(job_config.model.flavor)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tokenizer = None
    if job_config.model.tokenizer_path and spec.build_tokenizer_fn is not None:
        tokenizer = spec.build_tokenizer_fn(job_config)
    model_args.update_from_config(job_config, tokenizer)
    return model_args


def build_parallelized_meta_model(
    job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device
) -> MetaBuild:
    """Model on meta, converters, then the spec's parallelize_fn, or under pipeline parallel
    its pipelining_fn (this rank's stages and the schedule, whose stages live on
    ``device``). Must run outside FakeTensorMode (torch >= 2.13 cannot swap fake parameters
    in ``Module._apply``)."""
    spec = get_train_spec(job_config.model.name)
    model_args = estimation_model_args(job_config, spec)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    ModelConvertersContainer(job_config, parallel_dims).convert(model)
    accum = grad_accumulation_steps(job_config, parallel_dims)
    loss_fn = rescale_accumulated_loss(spec.build_loss_fn(job_config), accum)
    pipeline = None
    if parallel_dims.pp_enabled:
        pipeline = spec.pipelining_fn(model, parallel_dims, job_config, device, model_args,
                                      spec.parallelize_fn, loss_fn)
        parts = pipeline.model_parts
    else:
        parts = [spec.parallelize_fn(model, parallel_dims, job_config)]
    return MetaBuild(spec, model_args, parts, pipeline, loss_fn, accum)


def grad_accumulation_steps(job_config: JobConfig, parallel_dims: ParallelDims) -> int:
    """Micro-batches per step, as the trainer derives them."""
    training = job_config.training
    per_pass = training.local_batch_size * parallel_dims.dp_degree
    global_batch = training.global_batch_size if training.global_batch_size > 0 else per_pass
    if global_batch % per_pass != 0:
        raise ConfigError(
            f"training.global_batch_size ({global_batch}) must be a multiple of local_batch_size "
            f"x data-parallel degree ({training.local_batch_size} x {parallel_dims.dp_degree} = {per_pass})"
        )
    return global_batch // per_pass


def train_context_factory(
    job_config: JobConfig, parallel_dims: ParallelDims, device_type: str
) -> Callable[[], contextlib.AbstractContextManager]:
    """The trainer's forward-and-backward context: loss parallel under TP (unless disabled),
    autocast where FSDP does not cast parameters itself."""
    dtype = TORCH_DTYPES[job_config.training.mixed_precision_param]
    use_autocast = dtype != torch.float32 and not parallel_dims.fsdp_enabled
    use_loss_parallel = parallel_dims.tp_enabled and not job_config.parallelism.disable_loss_parallel

    @contextlib.contextmanager
    def context():
        with contextlib.ExitStack() as stack:
            if use_loss_parallel:
                stack.enter_context(loss_parallel())
            if use_autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield

    return context


def build_training_setup(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    device: torch.device,
    *,
    init_seed: int,
) -> TrainingSetup:
    """Everything for the training steps on real tensors, weights initialised from
    ``init_seed`` (a fake build calls the two halves itself, around FakeTensorMode)."""
    meta = build_parallelized_meta_model(job_config, parallel_dims, device)
    return materialize_setup(job_config, parallel_dims, device, meta, init_seed)


def materialize_setup(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    device: torch.device,
    meta: MetaBuild,
    init_seed: int | None,
) -> TrainingSetup:
    for part in meta.model_parts:
        part.to_empty(device=device)
        if init_seed is not None:
            with torch.no_grad():
                part.init_weights(seed=init_seed)
        part.train()
    optimizers = meta.spec.build_optimizers_fn(meta.model_parts, job_config, parallel_dims)
    lr_schedulers = meta.spec.build_lr_schedulers_fn(optimizers, job_config)
    return TrainingSetup(
        job_config=job_config,
        spec=meta.spec,
        model_args=meta.model_args,
        parallel_dims=parallel_dims,
        model_parts=meta.model_parts,
        pipeline=meta.pipeline,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        loss_fn=meta.loss_fn,
        grad_accum_steps=meta.grad_accum_steps,
        train_context=train_context_factory(job_config, parallel_dims, device.type),
        device=device,
    )
