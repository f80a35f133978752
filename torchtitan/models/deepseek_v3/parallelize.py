"""Applies parallelisms to a DeepSeek-V3 model in a fixed order: tensor parallel (attention
and dense FFNs), context parallel (attention), expert / expert-tensor parallel (MoE layers),
activation checkpointing, then FSDP/HSDP (experts over ``efsdp`` first) or DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config.errors import ConfigError
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.data_parallel import (
    apply_ddp,
    apply_fsdp,
    reshard_after_forward_policy,
)
from torchtitan.distributed.expert_parallel import apply_expert_fsdp, parallelize_moe
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.logging import logger


def parallelize_deepseek_v3(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    if job_config.compile.enable:
        raise ConfigError(
            "compile.enable: not supported for deepseek_v3 yet (MoE routing and expert "
            "parallel sync with the host); run without --compile.enable"
        )
    if job_config.parallelism.enable_async_tensor_parallel:
        raise ConfigError("parallelism.enable_async_tensor_parallel: not supported for deepseek_v3")
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.world_mesh["tp"],
                 loss_parallel=not job_config.parallelism.disable_loss_parallel)
    if parallel_dims.cp_enabled:
        p = job_config.parallelism
        apply_cp(model, parallel_dims.world_mesh["cp"], p.context_parallel_rotate_method,
                 p.context_parallel_load_balancer)
    moes = [block.moe for block in model.layers.values() if block.moe_enabled]
    for moe in moes:
        parallelize_moe(moe, parallel_dims)
    if parallel_dims.ep_enabled:
        logger.info(f"applied expert parallel over {parallel_dims.ep} ranks "
                    f"(expert tensor parallel {parallel_dims.etp})")

    ac = job_config.activation_checkpoint
    apply_ac(model.layers, ac.mode, ac.selective_ac_option)

    if parallel_dims.fsdp_enabled:
        training = job_config.training
        fsdp_kwargs = {
            "param_dtype": TORCH_DTYPES[training.mixed_precision_param],
            "reduce_dtype": TORCH_DTYPES[training.mixed_precision_reduce],
            "reshard_after_forward": reshard_after_forward_policy(
                job_config.parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled
            ),
            "cpu_offload": training.enable_cpu_offload,
        }
        if parallel_dims.ep_enabled:
            for moe in moes:
                apply_expert_fsdp(moe, parallel_dims, **fsdp_kwargs)
        apply_fsdp(model, parallel_dims.fsdp_mesh, list(model.layers.values()), **fsdp_kwargs)
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.world_mesh["dp_replicate"])
    return model


class _SumGradFrom(torch.autograd.Function):
    """Identity forward; in backward, all-reduce (sum) the gradient's channels from
    ``start`` on over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad[..., ctx.start:].contiguous()
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
        return tuple(x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()])
                     for x in inputs)

    def _to_local(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        if self.sum_grad_from is None:
            return output.to_local()
        return _SumGradFrom.apply(output.to_local(), self.sum_grad_from, mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, self._to_dtensor, self._to_local)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallel, as for Llama 3: activations between
    blocks are sharded on the sequence; MLA heads are sharded (``wq``/``wq_b``/``wkv_b``
    column-wise, ``wo`` row-wise) while the latent projections and norms are replicated;
    dense FFNs as in Llama 3. MoE layers are handled by ``parallelize_moe``."""
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    present = {k: v for k, v in root_plan.items() if getattr(model, k, None) is not None}
    parallelize_module(model, tp_mesh, present)
    for block in model.layers.values():
        attention = block.attention
        plan: dict[str, ParallelStyle] = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wkv_a": ReplicateParallel(sum_grad_from=attention.kv_lora_rank),
            "attention.kv_norm": ReplicateParallel(),
            "attention.wkv_b": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if hasattr(attention, "wq"):
            plan["attention.wq"] = ColwiseParallel()
        else:
            plan |= {"attention.wq_a": ReplicateParallel(), "attention.q_norm": ReplicateParallel(),
                     "attention.wq_b": ColwiseParallel()}
        if not block.moe_enabled:
            plan |= {
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            }
        parallelize_module(block, tp_mesh, plan)
    logger.info(f"applied tensor + sequence parallel over {tp_mesh.size()} ranks "
                f"(loss parallel {'on' if loss_parallel else 'off'})")

