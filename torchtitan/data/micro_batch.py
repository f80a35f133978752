"""A micro-batch, the step's micro-batches fetched onto the device, and what the model
receives from one on this rank."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from torchtitan.distributed import ParallelDims
from torchtitan.distributed.context_parallel.layout import cp_shard, shard_batch_for_cp
from torchtitan.layers.attention import document_positions


@dataclass
class MicroBatch:
    """One micro-batch on the training device: token ids and labels ``[batch, seq]``
    (labels may hold IGNORE_INDEX) and which packed document each token belongs to (None:
    one document per sequence); GRPO's rollouts carry one advantage per sequence."""

    inputs: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor | None = None
    advantages: torch.Tensor | None = None


class DeviceBatches:
    """The step's ``count`` micro-batches moved to ``device``, counting this rank's tokens
    and the time spent waiting for data (one instance per step). ``mark`` names the phase
    that starts: "data" at each fetch, "sync" after the last one (the token count
    all-reduce that follows is a sync)."""

    def __init__(
        self,
        data_iterator: Iterator,
        device: torch.device,
        count: int,
        mark: Callable[[str], None],
    ) -> None:
        self.data_iterator = data_iterator
        self.device = device
        self.count = count
        self.mark = mark
        self.tokens = 0
        self.seconds = 0.0
        self.calls = 0

    def __call__(self) -> MicroBatch:
        self.mark("data")
        start = time.perf_counter()
        input_dict, labels = next(self.data_iterator)
        inputs = input_dict["input"].to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        document_ids = input_dict.get("document_ids")
        if document_ids is not None:
            document_ids = document_ids.to(self.device, non_blocking=True)
        self.tokens += labels.numel()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        if self.calls == self.count:
            self.mark("sync")
        return MicroBatch(inputs, labels, document_ids)


class PreparedBatches:
    """A step's micro-batches made on the device beforehand (GRPO's rollouts), served in
    order; ``tokens`` and ``seconds`` as ``DeviceBatches`` counts them."""

    def __init__(self, batches: list[MicroBatch], seconds: float) -> None:
        self._batches = list(batches)
        self.tokens = sum(batch.labels.numel() for batch in batches)
        self.seconds = seconds

    def __call__(self) -> MicroBatch:
        return self._batches.pop(0)


def model_inputs(
    batch: MicroBatch, parallel_dims: ParallelDims, reset_positions: bool = False
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(inputs, labels, model kwargs)`` of this rank: under context parallel its share of
    the sequences with their global positions; the document ids of the whole sequences (the
    attention kernels read the sequence length from them and mask documents under
    block_causal), and positions restarting at each document with ``reset_positions``
    (``training.reset_position_ids_per_document``). Under pipeline parallel every kwarg has
    the batch dimension first (the schedule splits them into micro-batches)."""
    inputs, labels, document_ids = batch.inputs, batch.labels, batch.document_ids
    per_sequence = parallel_dims.pp_enabled
    kwargs: dict[str, torch.Tensor] = {}
    positions = None
    if document_ids is not None and reset_positions:
        positions = document_positions(document_ids)
    if parallel_dims.cp_enabled:
        cp_mesh = parallel_dims.world_mesh["cp"]
        balancer = parallel_dims.cp_load_balancer
        inputs, labels, cp_positions = shard_batch_for_cp(inputs, labels, cp_mesh, balancer)
        if positions is None:  # one row for every sequence; per sequence for pipeline stages,
            # whose schedule splits every model input into micro-batches along dim 0
            positions = cp_positions.expand(inputs.shape[0], -1) if per_sequence else cp_positions
        else:
            positions = cp_shard(positions, 1, cp_mesh, balancer)
    if positions is not None:
        kwargs["positions"] = positions
    if document_ids is not None:
        kwargs["document_ids"] = document_ids
    return inputs, labels, kwargs
