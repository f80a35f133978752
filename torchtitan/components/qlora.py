"""QLoRA: ``lora.base_quantization = "nf4"`` stores the frozen base weight of every adapted
linear as a torchao ``NF4Tensor`` (4-bit NormalFloat in blocks of 64 values, block scales
double-quantized in groups of 256), dequantized to the compute dtype inside each matmul.

The base is quantized once its values are final (after the initial load or the resume):
each weight is gathered, quantized whole and split into its FSDP rows. Quantizing the whole
tensor keeps its one scale mean and every block exactly as one process quantizes it, so every
layout trains the same NF4 model; the cost is one full weight per rank while it is quantized.
FSDP all-gathers the shards' NF4 bytes (torchao's ``fsdp_pre_all_gather``), so the gathered
weight is 4-bit too. Layouts NF4 does not support are refused by ``check_qlora`` at preflight.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.config.errors import ConfigError
from torchtitan.layers.lora import adapted_linears
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims

NF4 = "nf4"
FIELD = "lora.base_quantization"
BLOCK = 64  # values per absmax block (the QLoRA paper's and torchao's default)
SCALER_BLOCK = 256  # block scales per double-quantization group
BLOCK_VALUES = BLOCK * SCALER_BLOCK  # the smallest unit a weight can be split into
# Bytes per stored value: 4 bits, an int8 scale per block, an fp32 factor per scale group.
NF4_BYTES_PER_VALUE = 0.5 + 1 / BLOCK + 4 / BLOCK_VALUES
# What torchao's to_nf4 holds at once for an fp32 weight of a million values or more: the
# weight, its scaled copy, a byte per value and the packed halves (9.6 bytes per value),
# and a chunk's distances to the 16 levels (128 MiB). Checked on fake tensors in test_qlora.py.
QUANTIZE_BYTES_PER_VALUE = 9.6
QUANTIZE_SCRATCH_BYTES = 128 * 2**20
LOW_PRECISION_CONVERTERS = ("float8", "quantize.linear.float8", "mx", "quantize.linear.mx")


def uses_nf4(job_config: JobConfig) -> bool:
    return job_config.lora.base_quantization == NF4


def import_to_nf4() -> Callable[..., Any]:
    """torchao's ``to_nf4``, or a ConfigError naming the setting."""
    try:
        from torchao.quantization import to_nf4
    except ImportError:
        raise ConfigError(
            f'{FIELD}: "nf4" needs torchao (pip install "torchao>=0.18"), which is not '
            'installed; install it or set lora.base_quantization = "none"'
        ) from None
    return to_nf4


def fsdp_shards(parallel_dims: ParallelDims) -> int:
    """How many FSDP shards each dense weight is split into (data shard x context parallel)."""
    return parallel_dims.dp_shard * parallel_dims.cp if parallel_dims.fsdp_enabled else 1


def check_qlora(
    job_config: JobConfig, parallel_dims: ParallelDims, targets: dict[str, nn.Linear]
) -> None:
    """One-line refusals, before any process starts, for what NF4 bases cannot do."""
    if not uses_nf4(job_config):
        return
    if importlib.util.find_spec("torchao") is None:  # found, not imported: its import is noisy
        import_to_nf4()
    if parallel_dims.tp_enabled:
        raise ConfigError(
            f"{FIELD}: nf4 does not compose with parallelism.tensor_parallel_degree > 1 (NF4 "
            "weights split only by rows, as FSDP shards them); use FSDP or HSDP, with PP or "
            "CP if needed"
        )
    clash = [name for name in job_config.model.converters if name in LOW_PRECISION_CONVERTERS]
    if clash:
        raise ConfigError(
            f"{FIELD}: nf4 and model.converters {clash[0]!r} would both replace the base "
            "weights of the adapted linears; drop one of them"
        )
    if not job_config.lora.save_adapters_only:
        raise ConfigError(
            f"{FIELD}: nf4 needs lora.save_adapters_only = true (the NF4 base is re-made "
            "from checkpoint.initial_load_path at every start, never saved)"
        )
    shards = fsdp_shards(parallel_dims)
    for fqn, linear in targets.items():
        rows, cols = linear.weight.shape
        groups, rest = divmod(rows * cols, BLOCK_VALUES)
        if rest or groups % shards or rows % shards:
            raise ConfigError(
                f"{FIELD}: nf4 stores weights in groups of {BLOCK_VALUES:,} values and each "
                f"of the {shards} FSDP shard(s) must hold whole groups and rows; {fqn}.weight "
                f"({rows} x {cols}) does not split so: leave it out of lora.target_modules "
                "or change the FSDP degree"
            )


def quantize_base(model_parts: list[nn.Module]) -> None:
    """Replace the base weight of every adapted linear by its NF4 quantization (a collective
    under FSDP: call it on every rank, after the base is loaded)."""
    to_nf4 = import_to_nf4()
    linears = adapted_linears(model_parts)
    before = after = 0
    for linear in linears.values():
        weight = linear.weight
        before += _local(weight).numel() * weight.element_size()
        quantized = _quantized(weight, to_nf4)
        linear.weight = nn.Parameter(quantized, requires_grad=False)
        after += round(_local(quantized).numel() * NF4_BYTES_PER_VALUE)
    logger.info(
        f"lora: the base weights of {len(linears)} adapted linears are NF4 now "
        f"({before / 2**20:,.1f} MiB -> {after / 2**20:,.1f} MiB on this rank)"
    )


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


@torch.no_grad()
def _quantized(weight: torch.Tensor, to_nf4: Callable[..., Any]) -> torch.Tensor:
    if not isinstance(weight, DTensor):
        return to_nf4(weight.detach().contiguous(), BLOCK, SCALER_BLOCK)
    mesh, placements = weight.device_mesh, weight.placements
    local = to_nf4(weight.full_tensor().contiguous(), BLOCK, SCALER_BLOCK)
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():  # Shard(0): FSDP's rows (check_qlora refuses TP)
            local = torch.chunk(local, mesh.size(mesh_dim), dim=0)[mesh.get_local_rank(mesh_dim)]
    # FSDP keeps the old shard as a view of its padded storage: freeing that storage returns
    # the high-precision bytes and lets FSDP's lazy init adopt the new (NF4) shard.
    weight.to_local().untyped_storage().resize_(0)
    return DTensor.from_local(
        local, mesh, placements, shape=weight.shape, stride=weight.stride(), run_check=False
    )
