"""LoRA fine-tuning: the ``lora`` model converter and the tensor-parallel styles of adapted
linears.

The converter attaches adapters (``lora_linear.py``) to the linears that
``lora.target_modules`` selects and freezes every other parameter, so the base gets no
gradients, no optimizer state and no share of the gradient norm. Under tensor parallel the
adapters are placed so that the adapted layer computes exactly what one device computes:

* column-wise base (q/k/v, w1/w3, output; weight ``Shard(0)``): ``lora_a`` replicated,
  ``lora_b`` ``Shard(0)``, so the adapter's output is sharded like the base's;
* row-wise base (o, w2; weight ``Shard(1)``): ``lora_a`` ``Shard(1)`` (the sharded input
  dim), ``lora_b`` replicated, so the adapter's output is a partial sum reduced with the
  base's in the same reduce-scatter.
"""

from __future__ import annotations

import fnmatch
import re
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchtitan.components.adapters.lora_linear import add_lora, has_lora
from torchtitan.config.errors import ConfigError
from torchtitan.layers.moe import GroupedExperts
from torchtitan.protocols.model_converter import register_model_converter
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import LoRAConfig
    from torchtitan.distributed import ParallelDims

LORA = "lora"
PRESETS = {
    "attention": re.compile(r"layers\.\d+\.attention\.[^.]+"),
    "mlp": re.compile(r"layers\.\d+\.feed_forward\.[^.]+"),
    "output": re.compile(r"output"),
}


def matches_target(pattern: str, fqn: str) -> bool:
    """Whether ``pattern`` (a preset, an FQN glob or a last name) selects ``fqn``."""
    if pattern in PRESETS:
        return PRESETS[pattern].fullmatch(fqn) is not None
    return fnmatch.fnmatchcase(fqn, pattern) or fqn.rsplit(".", 1)[-1] == pattern


def select_targets(model: nn.Module, patterns: list[str]) -> dict[str, nn.Linear]:
    """The linears (by FQN) that ``patterns`` select; ConfigError naming
    ``lora.target_modules`` for a pattern that selects nothing or selects MoE experts."""
    targets: dict[str, nn.Linear] = {}
    for pattern in patterns:
        hits = [
            (fqn, m) for fqn, m in model.named_modules() if fqn and matches_target(pattern, fqn)
        ]
        if any(isinstance(m, GroupedExperts) for _, m in hits):
            raise ConfigError(
                f"lora.target_modules: {pattern!r} selects MoE routed experts, which take no "
                "adapters here; target attention, the dense mlp or the output instead"
            )
        linears = {fqn: m for fqn, m in hits if isinstance(m, nn.Linear)}
        if not linears:
            raise ConfigError(
                f"lora.target_modules: {pattern!r} matches no linear layer of this model; use "
                f"a preset ({', '.join(PRESETS)}), an FQN glob such as layers.*.attention.wq, "
                "or a layer name such as wq"
            )
        _refuse_tied(pattern, linears, model)
        targets.update(linears)
    return targets


def _refuse_tied(pattern: str, linears: dict[str, nn.Linear], model: nn.Module) -> None:
    """A linear whose weight is also the input embedding (tied embeddings) cannot take an
    adapter: merged, it would no longer be the embedding it is saved as."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for fqn, linear in linears.items():
        if id(linear.weight) in embeddings:
            raise ConfigError(
                f"lora.target_modules: {pattern!r} selects {fqn}, whose weight is tied to the "
                "input embedding (tie_word_embeddings); leave it out"
            )


def trainable_summary(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (tied parameters counted once)."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


class LoRAConverter:
    """``model.converters = ["lora"]``: adapters on the ``lora.target_modules`` linears; the
    rest of the model frozen."""

    def __init__(self, settings: LoRAConfig, parallel_dims: ParallelDims | None) -> None:
        self.settings = settings

    def convert(self, model: nn.Module) -> None:
        s = self.settings
        targets = select_targets(model, s.target_modules)
        for param in model.parameters():
            param.requires_grad_(False)
        for linear in targets.values():
            add_lora(linear, s.rank, s.alpha, s.dropout)
        trainable, total = trainable_summary(model)
        logger.info(
            f"lora: rank {s.rank}, alpha {s.alpha:g} on {len(targets)} linears "
            f"({', '.join(s.target_modules)}); trainable parameters {trainable:,} of "
            f"{total:,} ({100 * trainable / total:.2f}%)"
        )

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        pass


# ---------------------------------------------------------------------------- TP styles
def _distribute_adapters(module: nn.Module, mesh: Any, a_placement: Any, b_placement: Any) -> None:
    for name, placement in (("lora_a", a_placement), ("lora_b", b_placement)):
        param = getattr(module, name)
        module.register_parameter(
            name,
            nn.Parameter(
                distribute_tensor(param, mesh, [placement], src_data_rank=None),
                requires_grad=param.requires_grad,
            ),
        )


def _lora_style(style: Any) -> Any:
    """``style`` (a column- or row-wise style, float8 ones included) with a partition that
    places the adapters as the module docstring says and the base as before."""
    colwise = isinstance(style, ColwiseParallel)
    base_cls = type(style)

    def partition(self, name: str, module: nn.Module, mesh: Any) -> None:
        adapters = {n: module._parameters.pop(n) for n in ("lora_a", "lora_b")}
        base_cls._partition_linear_fn(self, name, module, mesh)
        module._parameters.update(adapters)
        if colwise:
            _distribute_adapters(module, mesh, Replicate(), Shard(0))
        else:
            _distribute_adapters(module, mesh, Shard(1), Replicate())

    lora_cls = type(f"LoRA{base_cls.__name__}", (base_cls,), {"_partition_linear_fn": partition})
    adapted = object.__new__(lora_cls)
    adapted.__dict__.update(style.__dict__)
    return adapted


def with_lora_styles(module: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` with the styles of adapted linears made adapter-aware."""
    linear_styles = (ColwiseParallel, RowwiseParallel)
    return {
        path: _lora_style(style)
        if isinstance(style, linear_styles) and has_lora(module.get_submodule(path))
        else style
        for path, style in plan.items()
    }


register_model_converter(LoRAConverter, LORA, config_section=LORA)
