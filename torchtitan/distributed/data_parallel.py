"""FSDP2 / HSDP / DDP application, shared by every model's parallelize function."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from torchtitan.tools.dtypes import TORCH_DTYPES  # noqa: F401  (re-exported for components/checkpointing/manager.py and scripts/generate)
from torchtitan.tools.logging import logger


def reshard_after_forward_policy(policy: str, pp_enabled: bool) -> bool:
    """default = reshard except under pipeline parallel (where stages run several
    micro-batches back to back and would re-gather every time)."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    return not pp_enabled


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: list[nn.Module],
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool = False,
) -> None:
    """fully_shard each block, then the root (embedding, final norm, output)."""
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    kind = "HSDP" if mesh.ndim == 2 else "FSDP"
    logger.info(
        f"applied {kind} over mesh {tuple(mesh.shape)} (param {param_dtype}, reduce {reduce_dtype})"
    )


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
    logger.info(f"applied DDP over {mesh.size()} replicas")
