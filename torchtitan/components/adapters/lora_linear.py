"""Low-rank adapters on a linear layer, kept outside the layer's own parameters.

``add_lora`` gives an ``nn.Linear`` (or a subclass: float8, NF4) two parameters,
``lora_a`` ``[rank, in]`` and ``lora_b`` ``[out, rank]``, and a forward hook that adds
``scaling * dropout(x) @ lora_a.T @ lora_b.T`` to the layer's output. The base weight keeps
its FQN (``...wq.weight``), so base checkpoints load unchanged, the layer keeps its class, so
the tensor-parallel styles and quantized subclasses still apply, and the adapters are
``...wq.lora_a`` / ``...wq.lora_b``. A hook rather than a wrapper module: a wrapper would
move the base weight to a new FQN and hide the layer's type from every plan that matches it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.layers.init import InitFn, clean_fqn

LORA_PARAMS = ("lora_a", "lora_b")


def lora_a_init(t: torch.Tensor, g: torch.Generator) -> None:
    """PEFT's and the LoRA paper's default for A: Kaiming-uniform with a = sqrt(5), i.e.
    U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(t.shape[1])
    torch.nn.init.uniform_(t, -bound, bound, generator=g)


def lora_b_init(t: torch.Tensor, g: torch.Generator) -> None:
    """B starts at zero, so the adapted model equals the base model at step 0."""
    del g
    torch.nn.init.zeros_(t)


def _lora_forward_hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor):
    if not module.lora_enabled:
        return None
    x = args[0]
    if module.lora_dropout > 0:
        x = F.dropout(x, module.lora_dropout, module.training)
    return output + F.linear(F.linear(x, module.lora_a), module.lora_b) * module.lora_scaling


def add_lora(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    """Attach adapters of ``rank`` (scaling ``alpha / rank``, as PEFT) to ``linear`` in
    place, on the base weight's device and dtype. Their values are set by the model's
    ``init_weights`` through ``param_init_fns`` (A uniform, B zero)."""
    weight = linear.weight
    out_features, in_features = weight.shape
    kwargs = {"device": weight.device, "dtype": _adapter_dtype(weight)}
    linear.lora_a = nn.Parameter(torch.empty(rank, in_features, **kwargs))
    linear.lora_b = nn.Parameter(torch.empty(out_features, rank, **kwargs))
    linear.lora_scaling = alpha / rank
    linear.lora_dropout = dropout
    linear.lora_enabled = True
    linear.param_init_fns: dict[str, InitFn] = {"lora_a": lora_a_init, "lora_b": lora_b_init}
    linear.register_forward_hook(_lora_forward_hook)


def _adapter_dtype(weight: torch.Tensor) -> torch.dtype:
    """Adapters train in the floating dtype the base computes in (an NF4 base: its
    high-precision dtype)."""
    return weight.dtype if weight.dtype.is_floating_point else torch.float32


def merged_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The plain weight that computes what ``weight`` with these adapters computes (an NF4
    base dequantized: ``to(dtype)`` is how NF4 tensors turn plain)."""
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return (weight.to(torch.float32) + delta).to(weight.dtype)


def has_lora(module: nn.Module) -> bool:
    return isinstance(getattr(module, "lora_a", None), nn.Parameter)


def is_lora_param(fqn: str) -> bool:
    return fqn.rsplit(".", 1)[-1] in LORA_PARAMS


@contextlib.contextmanager
def adapters_off(model_parts: list[nn.Module]) -> Iterator[None]:
    """Inside, every adapter is skipped: the parts compute as the base model (DPO's
    reference under LoRA, without a second copy of the weights)."""
    linears = [m for part in model_parts for m in part.modules() if has_lora(m)]
    for linear in linears:
        linear.lora_enabled = False
    try:
        yield
    finally:
        for linear in linears:
            linear.lora_enabled = True


def adapted_linears(model_parts: list[nn.Module]) -> dict[str, nn.Module]:
    """The linears with adapters in ``model_parts``, by their unwrapped FQN."""
    return {
        clean_fqn(prefix): module
        for part in model_parts
        for prefix, module in part.named_modules()
        if has_lora(module)
    }
