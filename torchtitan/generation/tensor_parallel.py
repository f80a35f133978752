"""Tensor parallel for Llama 3 generation: the training plan minus sequence parallel.

Training shards activations on the sequence dim between blocks (sequence parallel), which
needs every forward's length divisible by the TP degree; decoding feeds one token at a
time, so here activations stay replicated and only the weights are sharded.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

_BLOCK_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
}


def apply_tp_minus_sp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """q/k/v and w1/w3 column-wise, wo and w2 row-wise, the embedding row-wise and the
    output column-wise with replicated (all-gathered) logits."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _BLOCK_PLAN)
