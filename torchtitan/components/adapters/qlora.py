"""QLoRA: ``lora.base_quantization = "nf4"`` stores the frozen base weight of every adapted
linear as a torchao ``NF4Tensor`` (4-bit NormalFloat in blocks of 64 values, block scales
double-quantized in groups of 256), dequantized to the compute dtype inside each matmul.

The full-precision base never exists whole: the recipe leaves the adapted linears' weights
on meta (``PendingBase``) and, once the rest of the model is in place, they are made one
block at a time: allocated (this rank's shards), filled from the initial checkpoint (DCP or
Hugging Face) or the seeded initialisation, quantized, and the block's full-precision bytes
freed. Each weight is gathered and quantized whole, then split into its FSDP rows: that
keeps its one scale mean and every block exactly as one process quantizes it, so every
layout trains the same NF4 model. Each rank keeps its rows only (a copy, not views of the
whole). FSDP all-gathers the shards' NF4 bytes (torchao's ``fsdp_pre_all_gather``), so the
gathered weight is 4-bit too. Layouts NF4 does not support are refused by ``check_qlora``.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.components.adapters.lora_linear import has_lora
from torchtitan.config.errors import ConfigError
from torchtitan.layers.init import clean_fqn
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import LoRAConfig
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


def uses_nf4(lora: LoRAConfig) -> bool:
    return lora.base_quantization == NF4


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
    lora: LoRAConfig,
    converters: list[str],
    parallel_dims: ParallelDims,
    targets: dict[str, nn.Linear],
) -> None:
    """One-line refusals, before any process starts, for what NF4 bases cannot do with these
    converters, this layout and these adapted linears."""
    if not uses_nf4(lora):
        return
    if importlib.util.find_spec("torchao") is None:  # found, not imported: its import is noisy
        import_to_nf4()
    if parallel_dims.tp_enabled:
        raise ConfigError(
            f"{FIELD}: nf4 does not compose with parallelism.tensor_parallel_degree > 1 (NF4 "
            "weights split only by rows, as FSDP shards them); use FSDP or HSDP, with PP or "
            "CP if needed"
        )
    clash = [name for name in converters if name in LOW_PRECISION_CONVERTERS]
    if clash:
        raise ConfigError(
            f"{FIELD}: nf4 and model.converters {clash[0]!r} would both replace the base "
            "weights of the adapted linears; drop one of them"
        )
    if not lora.save_adapters_only:
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


class PendingBase:
    """The adapted linears' base weights while they are still on meta under QLoRA, by block
    (``layers.N``; a root linear is a group of its own). ``materialize_except`` allocates a
    model part without them, ``fill`` makes them NF4 a block at a time."""

    def __init__(self, model_parts: list[nn.Module], device: torch.device, seed: int | None):
        self.device, self.seed = device, seed
        self._groups: dict[str, list[_Base]] = {}
        for part in model_parts:
            for prefix, module in part.named_modules():
                if has_lora(module):
                    fqn = f"{clean_fqn(prefix)}.weight"
                    group = _BLOCK.match(fqn)
                    key = group.group(1) if group else fqn
                    self._groups.setdefault(key, []).append(_Base(part, module, fqn))
        self._ids = {id(b.linear.weight) for bases in self._groups.values() for b in bases}

    @property
    def fqns(self) -> set[str]:
        """The weights still pending (empty once filled)."""
        return {b.fqn for bases in self._groups.values() for b in bases}

    def materialize_except(self, part: nn.Module) -> None:
        """``part.to_empty(device)`` for everything but the pending weights (kept on meta)."""
        part._apply(  # what nn.Module.to_empty does, with the pending weights left on meta
            lambda t: torch.empty_like(t, device="meta" if id(t) in self._ids else self.device)
        )

    def fill(self, load: Callable[[dict[str, torch.Tensor]], None] | None) -> None:
        """Make every pending weight NF4, block by block: allocate the block (this rank's
        shards, in the meta weights' dtype), fill it with ``load`` (a checkpoint's values,
        in place) or else the seeded initialisation (seed None: leave it unset, as a
        fake-tensor trace does), quantize each weight, free the block. A collective under
        FSDP: call it on every rank."""
        if not self._groups:
            return
        to_nf4 = import_to_nf4()
        before = after = largest_block = 0
        for bases in self._groups.values():
            block = {b.fqn: b.allocate(self.device) for b in bases}
            if load is not None:
                load(block)
            elif self.seed is not None:
                bases[0].part.init_parameters(self.seed, set(block))
            block_bytes = sum(_local(w).numel() * w.element_size() for w in block.values())
            before, largest_block = before + block_bytes, max(largest_block, block_bytes)
            for base in bases:
                weight = block.pop(base.fqn)
                quantized = _quantized(weight, to_nf4)
                base.linear.weight = nn.Parameter(quantized, requires_grad=False)
                # the block's fp32 bytes go now, not when the last reference to them drops
                _local(weight).untyped_storage().resize_(0)
                after += round(_local(quantized).numel() * NF4_BYTES_PER_VALUE)
        logger.info(
            f"lora: the base weights of {len(self._ids)} adapted linears are NF4 now "
            f"({before / 2**20:,.1f} MiB -> {after / 2**20:,.1f} MiB on this rank; made a "
            f"block at a time, at most {largest_block / 2**20:,.1f} MiB in full precision)"
        )
        self._groups, self._ids = {}, set()


_BLOCK = re.compile(r"^(layers\.[^.]+)\.")


@dataclass
class _Base:
    part: nn.Module
    linear: nn.Module
    fqn: str

    def allocate(self, device: torch.device) -> torch.Tensor:
        """An uninitialised weight like the meta one (a DTensor: this rank's shard), set on
        the linear so that the model's init rules can find it by FQN."""
        meta = self.linear.weight
        if isinstance(meta, DTensor):
            local = torch.empty_like(meta.to_local(), device=device)
            weight = DTensor.from_local(
                local,
                meta.device_mesh,
                meta.placements,
                shape=meta.shape,
                stride=meta.stride(),
                run_check=False,
            )
        else:
            weight = torch.empty_like(meta, device=device)
        self.linear.weight = nn.Parameter(weight, requires_grad=False)
        return self.linear.weight


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
            rows = torch.chunk(local, mesh.size(mesh_dim), dim=0)[mesh.get_local_rank(mesh_dim)]
            local = own_storage(rows)
    return DTensor.from_local(
        local, mesh, placements, shape=weight.shape, stride=weight.stride(), run_check=False
    )


def own_storage(nf4: torch.Tensor) -> torch.Tensor:
    """An NF4 tensor holding copies of its inner tensors. torchao's chunk returns views of
    the whole weight's storage (each rank would keep the whole weight alive), and its clone
    re-quantizes the rows on their own (other values): neither will do."""
    names, context = nf4.__tensor_flatten__()
    inner = {name: getattr(nf4, name).clone() for name in names}
    return type(nf4).__tensor_unflatten__(inner, context, nf4.size(), nf4.stride())
