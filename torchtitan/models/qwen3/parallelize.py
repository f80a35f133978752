"""Applies parallelisms to a Qwen3 model: the shared decoder order and plans
(``models/common/parallelize.py``; the per-head q/k norms are in the GQA plan), with
expert / expert-tensor parallel for the MoE flavors, whose compile is refused for now."""

from __future__ import annotations

from torch import nn

from torchtitan.distributed import ParallelDims
from torchtitan.models.common.parallelize import parallelize_decoder, refuse_moe_compile


def parallelize_qwen3(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    if model.model_args.moe is not None:
        refuse_moe_compile(job_config, "the qwen3 MoE flavors")
    return parallelize_decoder(model, parallel_dims, job_config)
