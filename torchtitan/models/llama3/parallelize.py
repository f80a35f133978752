"""Applies parallelisms to a Llama 3 model: the shared decoder order and plans
(``models/common/parallelize.py``) with grouped-query attention blocks."""

from __future__ import annotations

from torch import nn

from torchtitan.distributed import ParallelDims
from torchtitan.models.common.parallelize import apply_tp, parallelize_decoder

__all__ = ["apply_tp", "parallelize_llama"]


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    """TP, CP, activation checkpointing, compile, then FSDP/HSDP (or DDP)."""
    return parallelize_decoder(model, parallel_dims, job_config)
