"""Layout-independent parameter initialisation.

Every parameter's *full* value is drawn from a generator seeded by a stable hash
of ``(seed, fqn)``; each rank then keeps only its own piece. Hence a model
initialised under FSDP, TP, PP or any mix of them starts from exactly the
weights a single process would produce (for a given device type), and a
pipeline stage that deleted some layers still gets the same values for the
layers it kept.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

InitFn = Callable[[torch.Tensor, torch.Generator], None]
"""Fills a full-size fp32 tensor in place, drawing randomness only from the generator."""

_WRAPPER_PREFIXES = (
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
    "_orig_mod.",
)


def clean_fqn(name: str) -> str:
    """Strip the module prefixes that FSDP1, activation checkpointing and
    ``torch.compile`` wrappers insert, giving the FQN of the unwrapped model."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_seed(seed: int, fqn: str) -> int:
    """A stable (process- and run-independent) 63-bit seed for one parameter."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_init(std: float) -> InitFn:
    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        torch.nn.init.normal_(t, mean=0.0, std=std, generator=g)

    return fill


def trunc_normal_init(std: float, cutoff_stds: float = 2.0) -> InitFn:
    """Normal(0, std) truncated to ``±cutoff_stds * std``."""
    bound = cutoff_stds * std

    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        torch.nn.init.trunc_normal_(t, mean=0.0, std=std, a=-bound, b=bound, generator=g)

    return fill


def ones_init(t: torch.Tensor, g: torch.Generator) -> None:
    del g  # deterministic
    torch.nn.init.ones_(t)


def zeros_init(t: torch.Tensor, g: torch.Generator) -> None:
    del g  # deterministic
    torch.nn.init.zeros_(t)


@torch.no_grad()
def init_param_(param: torch.Tensor, fqn: str, seed: int, init_fn: InitFn) -> None:
    """Initialise ``param`` in place with its slice of the full tensor that
    ``init_fn`` draws from the generator for ``(seed, fqn)``.

    The full tensor is generated in fp32 on the parameter's device (so the
    generator is a CPU or CUDA generator matching it) and copied, with a cast,
    into the parameter. For a DTensor the local piece is cut out with
    ``distribute_tensor(..., src_data_rank=None)``, which slices locally without
    communication.
    """
    generator = torch.Generator(device=param.device)
    generator.manual_seed(param_seed(seed, fqn))
    full = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    init_fn(full, generator)
    assign_full_(param, full)


@torch.no_grad()
def assign_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``param``'s piece of the full-size ``full`` into it (with a cast)."""
    if isinstance(param, DTensor):
        piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(piece.to_local())
    else:
        param.copy_(full)
