"""Applies parallelisms to a DeepSeek-V3 model: the shared decoder order
(``models/common/parallelize.py``: TP, CP, expert / expert-tensor parallel, activation
checkpointing, then FSDP/HSDP with experts over ``efsdp`` first, or DDP) with the MLA block
plan below. Preflight refuses compile for it (MoE layers)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from torchtitan.layers.decoder import TransformerBlock
from torchtitan.models.common.parallelize import (
    attention_input_plan,
    ffn_tp_plan,
    parallelize_decoder,
)


class _SumGradFrom(torch.autograd.Function):
    """Identity forward; in backward, all-reduce (sum) the gradient's channels from
    ``start`` on over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad[..., ctx.start :].contiguous()
        dist.all_reduce(summed, group=ctx.group)
        return torch.cat([grad[..., : ctx.start], summed], dim=-1), None, None


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over the tp mesh; the module takes and returns local tensors
    (for the small MLA projections and norms that every TP rank computes whole).

    ``sum_grad_from``: output channels from this index on feed head-sharded computation
    directly (``wkv_a``'s shared RoPE key), so their gradient is partial per rank and is
    summed; the other channels reach sharded weights through ColwiseParallel, which sums
    their gradient itself."""

    def __init__(self, sum_grad_from: int | None = None) -> None:
        super().__init__()
        self.sum_grad_from = sum_grad_from

    @staticmethod
    def _to_dtensor(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()])
            for x in inputs
        )

    def _to_local(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        if self.sum_grad_from is None:
            return output.to_local()
        return _SumGradFrom.apply(output.to_local(), self.sum_grad_from, mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, self._to_dtensor, self._to_local)


def mla_block_tp_plan(block: TransformerBlock) -> dict[str, ParallelStyle]:
    """MLA heads sharded (``wq``/``wq_b``/``wkv_b`` column-wise, ``wo`` row-wise) while the
    latent projections and norms are replicated; the feed-forward as in the shared plan."""
    attention = block.attention
    plan: dict[str, ParallelStyle] = attention_input_plan() | {
        "attention.wkv_a": ReplicateParallel(sum_grad_from=attention.kv_latent_rank),
        "attention.kv_norm": ReplicateParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if hasattr(attention, "wq"):
        plan["attention.wq"] = ColwiseParallel()
    else:
        plan |= {
            "attention.wq_a": ReplicateParallel(),
            "attention.q_norm": ReplicateParallel(),
            "attention.wq_b": ColwiseParallel(),
        }
    return plan | ffn_tp_plan(block)


parallelize_deepseek_v3 = functools.partial(parallelize_decoder, block_plan=mla_block_tp_plan)
"""The shared decoder's parallelisms with the MLA block plan."""
