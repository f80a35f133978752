"""Applies parallelisms to a gpt-oss model: the shared decoder order and plans
(``models/common/parallelize.py``), with each attention's per-head sinks sharded over the
tensor-parallel ranks like its heads."""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput

from torchtitan.layers.decoder import TransformerBlock
from torchtitan.models.common.parallelize import gqa_block_tp_plan, parallelize_decoder


class _AttentionInputAndSinks(PrepareModuleInput):
    """The attention's input gathered from sequence shards (as for every GQA block), and
    its ``sinks`` ``[heads]`` sharded over tp like the heads of ``wq``."""

    def __init__(self) -> None:
        super().__init__(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = distribute_tensor(module.sinks.detach(), device_mesh, [Shard(0)])
        module.sinks = nn.Parameter(sinks, requires_grad=module.sinks.requires_grad)
        return super()._apply(module, device_mesh)


def gpt_oss_block_tp_plan(block: TransformerBlock) -> dict[str, ParallelStyle]:
    return gqa_block_tp_plan(block) | {"attention": _AttentionInputAndSinks()}


parallelize_gpt_oss = functools.partial(parallelize_decoder, block_plan=gpt_oss_block_tp_plan)
"""The shared decoder's parallelisms with gpt-oss's block plan."""
