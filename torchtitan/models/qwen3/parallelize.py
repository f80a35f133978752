"""Applies parallelisms to a Qwen3 model: the shared decoder order and plans
(``models/common/parallelize.py``; the per-head q/k norms are in the GQA plan), with
expert / expert-tensor parallel for the MoE flavors (preflight refuses compile for them)."""

from __future__ import annotations

from torch import nn

from torchtitan.config import (
    ActivationCheckpointConfig,
    CompileConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan.distributed import ParallelDims
from torchtitan.models.common.parallelize import parallelize_decoder


def parallelize_qwen3(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    activation_checkpoint: ActivationCheckpointConfig,
    compile_config: CompileConfig,
) -> nn.Module:
    return parallelize_decoder(
        model,
        parallel_dims,
        training=training,
        parallelism=parallelism,
        activation_checkpoint=activation_checkpoint,
        compile_config=compile_config,
    )
