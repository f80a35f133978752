"""Applies parallelisms to a Llama 3 model in a fixed order: tensor parallel, context
parallel attention, activation checkpointing, compile, then FSDP/HSDP (or DDP). Reads ``parallel_dims.world_mesh`` itself."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.data_parallel import (
    apply_ddp,
    apply_fsdp,
    reshard_after_forward_policy,
)
from torchtitan.tools.compile import compile_blocks
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.logging import logger


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    training = job_config.training
    if parallel_dims.tp_enabled:
        loss_parallel = not job_config.parallelism.disable_loss_parallel
        tp_mesh = parallel_dims.world_mesh["tp"]
        apply_tp(model, tp_mesh, loss_parallel=loss_parallel)
        if job_config.parallelism.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh, compiled=job_config.compile.enable)

    if parallel_dims.cp_enabled:
        p = job_config.parallelism
        apply_cp(model, parallel_dims.world_mesh["cp"], p.context_parallel_rotate_method,
                 p.context_parallel_load_balancer)

    ac = job_config.activation_checkpoint
    apply_ac(model.layers, ac.mode, ac.selective_ac_option)

    if job_config.compile.enable and "model" in job_config.compile.components:
        compile_blocks(model.layers, job_config.compile.backend)

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


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallel: activations between blocks are sharded on
    the sequence dim; q/k/v and w1/w3 column-wise, wo and w2 row-wise; the embedding is
    row-wise (vocab-sharded) and the output column-wise, its logits left vocab-sharded for
    loss parallel."""
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    parallelize_module(model, tp_mesh, {k: v for k, v in root_plan.items() if getattr(model, k, None) is not None})
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    logger.info(f"applied tensor + sequence parallel over {tp_mesh.size()} ranks "
                f"(loss parallel {'on' if loss_parallel else 'off'})")


def enable_async_tp(tp_mesh: DeviceMesh, compiled: bool) -> None:
    """Overlap TP collectives with matmuls (inductor micro-pipelining over symmetric memory)."""
    if tp_mesh.device_type != "cuda" or not compiled:
        raise ValueError(
            "parallelism.enable_async_tensor_parallel needs CUDA and compile.enable; "
            f"this run has device {tp_mesh.device_type!r} and compile.enable={compiled}"
        )
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info("async tensor parallel enabled")
