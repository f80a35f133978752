"""Applies parallelisms to a Llama 3 model: the shared decoder order and plans
(``models/common/parallelize.py``) with grouped-query attention blocks."""

from __future__ import annotations

from torch import nn

from torchtitan.config import (
    ActivationCheckpointConfig,
    CompileConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan.distributed import ParallelDims
from torchtitan.models.common.parallelize import apply_tp, parallelize_decoder

__all__ = ["apply_tp", "parallelize_llama"]


def parallelize_llama(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    activation_checkpoint: ActivationCheckpointConfig,
    compile_config: CompileConfig,
) -> nn.Module:
    """TP, CP, activation checkpointing, compile, then FSDP/HSDP (or DDP)."""
    return parallelize_decoder(
        model,
        parallel_dims,
        training=training,
        parallelism=parallelism,
        activation_checkpoint=activation_checkpoint,
        compile_config=compile_config,
    )
