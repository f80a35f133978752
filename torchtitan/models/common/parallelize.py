"""Parallelisms for the shared decoder (``layers/decoder.py``), applied in one fixed order:
tensor parallel (+ sequence and loss parallel), context parallel, expert / expert-tensor
parallel for MoE layers, activation checkpointing, per-block compile, then FSDP/HSDP
(routed experts over ``efsdp`` first) or DDP. A model supplies the tensor-parallel plan of
its blocks, composed from the plans of the shared blocks below. Reads
``parallel_dims.world_mesh`` itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.components.adapters.lora import with_lora_styles
from torchtitan.components.quantization import float8_tensorwise_tp, with_float8_styles
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac, keeps_attention_output
from torchtitan.distributed.context_parallel.attention import apply_cp, has_local_attention
from torchtitan.distributed.context_parallel.delta_rule import apply_cp_to_delta_rules
from torchtitan.distributed.data_parallel import apply_ddp, apply_fsdp, reshard_after_forward_policy
from torchtitan.distributed.expert_parallel import apply_expert_fsdp, parallelize_moe
from torchtitan.layers.decoder import Decoder, TransformerBlock
from torchtitan.layers.gqa import GQAttention
from torchtitan.layers.moe import GroupedExperts
from torchtitan.tools.compile import compile_blocks
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import (
        ActivationCheckpointConfig,
        CompileConfig,
        ParallelismConfig,
        TrainingConfig,
    )

BlockPlan = Callable[[TransformerBlock], dict[str, ParallelStyle]]
"""A block -> its tensor-parallel plan (module path under the block -> style)."""


# ---------------------------------------------------------------------------- TP plans
def root_tp_plan(loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Embedding row-wise (vocab-sharded) producing sequence-sharded activations, final norm
    sequence-parallel, output column-wise with logits left vocab-sharded for loss parallel."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def attention_input_plan() -> dict[str, ParallelStyle]:
    """The block's first norm on sequence shards; attention gathers the whole sequence."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
    }


def gqa_tp_plan(attention: GQAttention) -> dict[str, ParallelStyle]:
    """Heads sharded: q/k/v column-wise, ``wo`` row-wise back to sequence shards. Per-head
    q/k norms see the local heads as shards of dim 2, so their replicated weights' gradients
    are summed over the tp ranks."""
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if attention.qk_norm:
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def feed_forward_tp_plan() -> dict[str, ParallelStyle]:
    """A dense SwiGLU: w1/w3 column-wise, w2 row-wise back to sequence shards."""
    return {
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def ffn_tp_plan(block: TransformerBlock) -> dict[str, ParallelStyle]:
    """``ffn_norm`` on sequence shards, then the dense plan (MoE layers are handled by
    ``parallelize_moe``)."""
    plan: dict[str, ParallelStyle] = {"ffn_norm": SequenceParallel()}
    return plan if block.moe_enabled else plan | feed_forward_tp_plan()


def gqa_block_tp_plan(block: TransformerBlock) -> dict[str, ParallelStyle]:
    """A block of grouped-query attention and a dense or MoE feed-forward."""
    return attention_input_plan() | gqa_tp_plan(block.attention) | ffn_tp_plan(block)


def apply_tp(
    model: Decoder,
    tp_mesh: DeviceMesh,
    loss_parallel: bool,
    block_plan: BlockPlan = gqa_block_tp_plan,
    float8_styles: bool = False,
) -> None:
    """Megatron-style TP with sequence parallel: activations between blocks are sharded on
    the sequence dim; each block by ``block_plan``; tied embeddings tied again.
    ``float8_styles``: Float8Linear targets take torchao's float8 styles; linears with LoRA
    adapters take adapter-aware styles."""

    def styled(module: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
        return with_lora_styles(module, with_float8_styles(module, plan) if float8_styles else plan)

    present = {
        k: v for k, v in root_tp_plan(loss_parallel).items() if getattr(model, k, None) is not None
    }
    parallelize_module(model, tp_mesh, styled(model, present))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, styled(block, block_plan(block)))
    model.tie_embeddings()  # both weights are Shard(0) over tp (the vocab)
    logger.info(
        f"applied tensor + sequence parallel over {tp_mesh.size()} ranks "
        f"(loss parallel {'on' if loss_parallel else 'off'})"
    )


def enable_async_tp(tp_mesh: DeviceMesh, compiled: bool) -> None:
    """Overlap TP collectives with matmuls (inductor micro-pipelining over symmetric memory)."""
    if tp_mesh.device_type != "cuda" or not compiled:
        raise ValueError(
            "parallelism.enable_async_tensor_parallel needs CUDA and compile.enable; "
            f"this run has device {tp_mesh.device_type!r} and compile.enable={compiled}"
        )
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info("async tensor parallel enabled")


# ---------------------------------------------------------------------------- the order
def fsdp_settings(
    training: TrainingConfig, parallelism: ParallelismConfig, parallel_dims: ParallelDims
) -> dict[str, Any]:
    """The keyword arguments of ``apply_fsdp`` / ``apply_expert_fsdp`` from the config."""
    return {
        "param_dtype": TORCH_DTYPES[training.mixed_precision_param],
        "reduce_dtype": TORCH_DTYPES[training.mixed_precision_reduce],
        "reshard_after_forward": reshard_after_forward_policy(
            parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled
        ),
        "cpu_offload": training.enable_cpu_offload,
    }


def parallelize_decoder(
    model: Decoder,
    parallel_dims: ParallelDims,
    *,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    activation_checkpoint: ActivationCheckpointConfig,
    compile_config: CompileConfig,
    block_plan: BlockPlan = gqa_block_tp_plan,
) -> Decoder:
    """Apply every enabled parallelism to ``model`` (or one pipeline stage of it) in place."""
    p = parallelism
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.world_mesh["tp"]
        apply_tp(
            model,
            tp_mesh,
            loss_parallel=not p.disable_loss_parallel,
            block_plan=block_plan,
            float8_styles=float8_tensorwise_tp(model, tp_mesh.device_type),
        )
        if p.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh, compiled=compile_config.enable)
    if parallel_dims.cp_enabled:
        cp_mesh = parallel_dims.world_mesh["cp"]
        linear = apply_cp_to_delta_rules(model, cp_mesh, parallel_dims.cp_load_balancer)
        # a pipeline stage may hold Gated DeltaNet layers only, or no block at all; a stage with
        # blocks but neither kind is refused by apply_cp
        if has_local_attention(model) or (not linear and len(model.layers) > 0):
            apply_cp(model, cp_mesh, parallel_dims.cp_rotate_method, parallel_dims.cp_load_balancer)
    moes = [block.moe for block in model.layers.values() if block.moe_enabled]
    for moe in moes:
        parallelize_moe(moe, parallel_dims)
    if moes and parallel_dims.ep_enabled:
        logger.info(
            f"applied expert parallel over {parallel_dims.ep} ranks "
            f"(expert tensor parallel {parallel_dims.etp})"
        )

    ac = activation_checkpoint
    apply_ac(
        model.layers,
        ac.mode,
        ac.selective_ac_option,
        ac.preserve_rng_state,
        keeps_attention_output(ac, parallel_dims.ring_cp),
        ac.memory_budget,
    )
    if compile_config.enable and "model" in compile_config.components:
        compile_blocks(
            model.layers,
            compile_config.backend,
            outside=lambda m: parallel_dims.ep_enabled and isinstance(m, GroupedExperts),
        )

    if parallel_dims.fsdp_enabled:
        settings = fsdp_settings(training, parallelism, parallel_dims)
        if parallel_dims.ep_enabled:
            for moe in moes:
                apply_expert_fsdp(moe.experts, parallel_dims, **settings)
        apply_fsdp(model, parallel_dims.fsdp_mesh, list(model.layers.values()), **settings)
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.world_mesh["dp_replicate"])
    return model
