"""Activation checkpointing: recompute activations in backward to save memory.

Modes: ``full`` wraps every block; ``selective`` with an integer N wraps every N-th block
(counted per model part); ``selective`` with ``op`` keeps a per-op policy: outputs of
attention, reduce-scatters and every other matmul are saved, everything else recomputed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import ActivationCheckpointConfig

_ATTENTION = {
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,
}
_ALWAYS_SAVE = _ATTENTION | {torch.ops._c10d_functional.reduce_scatter_tensor.default}
_MATMUL = torch.ops.aten.mm.default

# Profiler annotations produce nothing to save, and a nested FSDP unit inside a block (MoE
# experts over efsdp) runs a different number of them in forward and in recompute, which
# per-op checkpointing would otherwise reject as a mismatch.
SAC_IGNORED_OPS.update(
    {
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    }
)


def _op_level_policy():
    """Save attention and reduce-scatter outputs and every other matmul (counted separately
    in forward and in recompute so both make the same choices)."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _ALWAYS_SAVE:
            return CheckpointPolicy.MUST_SAVE
        if op == _MATMUL:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_level_context():
    """A fresh policy (fresh matmul counts) for every checkpointed block call."""
    return create_selective_checkpoint_contexts(_op_level_policy())


def _save_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _ATTENTION else CheckpointPolicy.PREFER_RECOMPUTE


def _save_attention_context():
    """Recompute the block but keep its attention output (and log-sum-exp): the attention
    kernel is the costliest op to recompute, its output one [tokens, heads x head_dim]."""
    return create_selective_checkpoint_contexts(_save_attention_policy)


def keeps_attention_output(ac: ActivationCheckpointConfig, ring_cp: bool) -> bool:
    """What ``activation_checkpoint.save_attention_output`` means for this AC mode: under
    "selective" the blocks that every-N selective AC recomputes keep their attention output,
    unless context parallel runs a ring (``ParallelDims.ring_cp``), which would keep every
    ring step's partial output."""
    if ac.save_attention_output != "selective":
        return ac.save_attention_output == "always"
    return ac.mode == "selective" and ac.selective_ac_option != "op" and not ring_cp


def apply_memory_budget(budget: float) -> None:
    """Mode memory_budget: no wrappers; torch's min-cut partitioner keeps at most ``budget``
    of each compiled block's activations for backward and recomputes the rest. Its setting
    is process-wide and read when a block compiles (at its first call), as upstream sets it."""
    functorch_config.activation_memory_budget = budget
    logger.info(f"activation checkpointing memory_budget: the compiled blocks keep {budget:g}")


def apply_ac(
    blocks: nn.ModuleDict,
    mode: str,
    selective_option: str,
    preserve_rng_state: bool = False,
    save_attention_output: bool = False,
    memory_budget: float = 0.5,
) -> None:
    """Wrap the blocks of one model part in place (FQNs gain no prefix in state dicts:
    checkpoint_wrapper's prefix is stripped by torch's state-dict hooks).
    ``preserve_rng_state`` restores the forward's RNG state for the recomputation.
    ``save_attention_output``: blocks that are recomputed whole (full, or every N-th) keep
    their attention output instead of recomputing it."""
    if mode == "none":
        return
    if mode == "memory_budget":
        apply_memory_budget(memory_budget)
        return
    kwargs = {"context_fn": _save_attention_context} if save_attention_output else {}
    if mode == "full":
        chosen = list(blocks.keys())
    elif selective_option == "op":
        chosen = list(blocks.keys())
        kwargs = {"context_fn": _op_level_context}
    else:
        every = int(selective_option)
        chosen = [name for i, name in enumerate(blocks.keys()) if (i + 1) % every == 0]
    for name in chosen:
        blocks.register_module(
            name, checkpoint_wrapper(blocks[name], preserve_rng_state=preserve_rng_state, **kwargs)
        )
    detail = f" ({selective_option})" if mode == "selective" else ""
    if kwargs.get("context_fn") is _save_attention_context:
        detail += ", attention outputs kept"
    logger.info(f"activation checkpointing {mode}{detail} on {len(chosen)}/{len(blocks)} blocks")
