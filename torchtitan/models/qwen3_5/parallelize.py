"""Applies parallelisms to a Qwen3.5 model: the shared decoder order
(``models/common/parallelize.py``) with a block plan for each mixer. Gated attention blocks
take the GQA plan (``wq`` holds each head's query and gate rows together, so its column
shards keep them together). Gated DeltaNet blocks shard heads too: the q/k/v/z/a/b
projections column-wise, the convolution taps, decay rates and ``dt_bias`` by channel or head
with them, ``out_proj`` row-wise back to sequence shards; the gated norm works per head and
is replicated, its gradient summed over the tp ranks (as for attention's q/k norms)."""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from torchtitan.layers.decoder import TransformerBlock
from torchtitan.layers.gated_deltanet import GatedDeltaNet
from torchtitan.models.common.parallelize import (
    attention_input_plan,
    ffn_tp_plan,
    gqa_block_tp_plan,
    parallelize_decoder,
)

_HEAD_SHARDED = ("q_conv", "k_conv", "v_conv", "dt_bias", "A_log")


class _MixerInputAndHeadParams(PrepareModuleInput):
    """The mixer's input gathered from sequence shards (as for attention), and its
    per-channel / per-head parameters (``_HEAD_SHARDED``) as Shard(0) DTensors over tp, in
    step with the column shards of the projections."""

    def __init__(self) -> None:
        super().__init__(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in _HEAD_SHARDED:
            param = getattr(module, name)
            sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
            setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return super()._apply(module, device_mesh)


def gated_deltanet_tp_plan() -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {"attention": _MixerInputAndHeadParams()}
    for name in ("q_proj", "k_proj", "v_proj", "z_proj", "a_proj", "b_proj"):
        plan[f"attention.{name}"] = ColwiseParallel()
    plan["attention.out_proj"] = RowwiseParallel(output_layouts=Shard(1))
    # one weight for every head: the local heads as shards of dim 2, gradients summed over tp
    plan["attention.norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def qwen3_5_block_tp_plan(block: TransformerBlock) -> dict[str, ParallelStyle]:
    if not isinstance(block.attention, GatedDeltaNet):
        return gqa_block_tp_plan(block)
    return attention_input_plan() | gated_deltanet_tp_plan() | ffn_tp_plan(block)


parallelize_qwen3_5 = functools.partial(parallelize_decoder, block_plan=qwen3_5_block_tp_plan)
"""The shared decoder's parallelisms with Qwen3.5's block plans."""
