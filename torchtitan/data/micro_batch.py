"""A micro-batch and what the model receives from it on this rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan.distributed import ParallelDims
from torchtitan.distributed.context_parallel.attention import cp_shard, shard_batch_for_cp
from torchtitan.layers.attention import document_positions


@dataclass
class MicroBatch:
    """One micro-batch on the training device: token ids and labels ``[batch, seq]``
    (labels may hold IGNORE_INDEX) and which packed document each token belongs to (None:
    one document per sequence)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor | None = None


def model_inputs(
    batch: MicroBatch, parallel_dims: ParallelDims, reset_positions: bool = False
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(inputs, labels, model kwargs)`` of this rank: under context parallel its share of
    the sequences with their global positions; the document ids of the whole sequences (the
    attention kernels read the sequence length from them and mask documents under
    block_causal), and positions restarting at each document with ``reset_positions``
    (``training.reset_position_ids_per_document``)."""
    inputs, labels, document_ids = batch.inputs, batch.labels, batch.document_ids
    kwargs: dict[str, torch.Tensor] = {}
    positions = None
    if document_ids is not None and reset_positions:
        positions = document_positions(document_ids)
    if parallel_dims.cp_enabled:
        cp_mesh = parallel_dims.world_mesh["cp"]
        balancer = parallel_dims.cp_load_balancer
        inputs, labels, cp_positions = shard_batch_for_cp(inputs, labels, cp_mesh, balancer)
        positions = cp_positions if positions is None else cp_shard(positions, 1, cp_mesh, balancer)
    if positions is not None:
        kwargs["positions"] = positions
    if document_ids is not None:
        kwargs["document_ids"] = document_ids
    return inputs, labels, kwargs
