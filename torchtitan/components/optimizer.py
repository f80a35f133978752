"""Optimizers over model parts (one optimizer per part, stepped together)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.layers.moe import moe_layers, update_expert_biases
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import OptimizerConfig
    from torchtitan.distributed import ParallelDims

_OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


class OptimizersContainer(Stateful):
    """One optimizer per model part (pipeline stages give several parts), behaving as one."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[torch.optim.Optimizer],
        kwargs: dict[str, Any],
    ) -> None:
        self.model_parts = model_parts
        self.optimizers = [
            optimizer_cls([p for p in part.parameters() if p.requires_grad], **kwargs)
            for part in model_parts
        ]

    def __iter__(self):
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def register_step_post_hook(self, hook) -> None:
        for opt in self.optimizers:
            opt.register_step_post_hook(hook)

    def state_dict(self) -> dict[str, Any]:
        """Keys are parameter FQNs (identical for every parallel layout)."""
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        merged: dict[str, Any] = {}
        for part, opt in zip(self.model_parts, self.optimizers):
            merged.update(get_optimizer_state_dict(part, opt, options=options))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for part, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(part, opt, optim_state_dict=state_dict, options=options)


def _implementation_kwargs(implementation: str, device_type: str) -> dict[str, bool]:
    if implementation == "fused":
        if device_type in _fused_supported_devices():
            return {"fused": True, "foreach": False}
        logger.warning(
            f"optimizer.implementation=fused is not available on {device_type}; using foreach"
        )
        return {"fused": False, "foreach": True}
    if implementation == "foreach":
        return {"fused": False, "foreach": True}
    return {"fused": False, "foreach": False}


@functools.cache
def _fused_supported_devices() -> tuple[str, ...]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return tuple(_get_fused_kernels_supported_devices())


def build_optimizers(
    model_parts: list[nn.Module], optimizer: OptimizerConfig, parallel_dims: ParallelDims | None
) -> OptimizersContainer:
    """One ``optimizer.name`` optimizer per model part over its trainable parameters."""
    cfg = optimizer
    param = next(p for part in model_parts for p in part.parameters())
    kwargs = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        **_implementation_kwargs(cfg.implementation, param.device.type),
    }
    return OptimizersContainer(model_parts, _OPTIMIZERS[cfg.name], kwargs)


def build_moe_optimizers(
    model_parts: list[nn.Module], optimizer: OptimizerConfig, parallel_dims: ParallelDims
) -> OptimizersContainer:
    """``build_optimizers`` plus a step pre-hook per model part that updates its MoE
    layers' expert biases (aux-loss-free load balancing, with the token counts of the
    gradients about to be applied)."""
    optimizers = build_optimizers(model_parts, optimizer, parallel_dims)
    group = parallel_dims.world_mesh["dp_cp"].get_group() if parallel_dims.dp_cp_enabled else None
    for part, optimizer in zip(model_parts, optimizers):
        moes = list(moe_layers([part]).values())
        if moes:
            optimizer.register_step_pre_hook(
                lambda *args, moes=moes, **kwargs: update_expert_biases(moes, group)
            )
    return optimizers
