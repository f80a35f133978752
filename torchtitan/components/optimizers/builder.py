"""Optimizers over model parts (one optimizer per part, stepped together)."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.components.optimizers.adam_states import AdamWithStateDtype
from torchtitan.components.optimizers.muon import NS_DTYPES, Muon, resolve_ns_dtype
from torchtitan.config import ConfigError
from torchtitan.config.job_config import DEFAULT_MUON_ADAMW_PARAMS, DEFAULT_WEIGHT_DECAY_EXCLUDE
from torchtitan.layers.moe import moe_layers, update_expert_biases
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import OptimizerConfig
    from torchtitan.distributed import ParallelDims

_OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


class OptimizersContainer(Stateful):
    """One optimizer per model part (pipeline stages give several parts), behaving as one.
    ``groups`` splits a part's trainable parameters into parameter groups (default: one)."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[torch.optim.Optimizer],
        kwargs: dict[str, Any],
        groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None,
    ) -> None:
        groups = groups or (lambda part: [{"params": trainable(part)}])
        self._hold(
            model_parts, [(part, optimizer_cls(groups(part), **kwargs)) for part in model_parts]
        )

    @classmethod
    def of(
        cls, model_parts: list[nn.Module], pairs: list[tuple[nn.Module, torch.optim.Optimizer]]
    ) -> OptimizersContainer:
        """Several optimizers per part (each over some of its parameters): (part, optimizer)."""
        container = cls.__new__(cls)
        container._hold(model_parts, pairs)
        return container

    def _hold(
        self, model_parts: list[nn.Module], pairs: list[tuple[nn.Module, torch.optim.Optimizer]]
    ) -> None:
        self.model_parts = model_parts
        self._owners = [part for part, _ in pairs]
        self.optimizers = [opt for _, opt in pairs]

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
        for part, opt in zip(self._owners, self.optimizers):
            merged.update(get_optimizer_state_dict(part, opt, options=options))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved state by FQN; each group's weight decay stays as configured (the
        groups come from ``optimizer.weight_decay_exclude``, which a resume may change)."""
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for part, opt in zip(self._owners, self.optimizers):
            configured = [group["weight_decay"] for group in opt.param_groups]
            set_optimizer_state_dict(part, opt, optim_state_dict=state_dict, options=options)
            for group, weight_decay in zip(opt.param_groups, configured):
                group["weight_decay"] = weight_decay


def trainable(part: nn.Module) -> list[nn.Parameter]:
    return [p for p in part.parameters() if p.requires_grad]


def _clean(name: str) -> str:
    """A parameter's name as in the checkpoint (no activation-checkpoint or compile wrapper)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class ParamGroups:
    """Splits parameters by FQN into parameter groups: weight decay 0 for the
    ``optimizer.weight_decay_exclude`` patterns, the learning rate times the first matching
    ``optimizer.lr_multipliers`` pattern's factor."""

    def __init__(self, exclude: list[str], lr_multipliers: dict[str, float]) -> None:
        self.exclude = exclude
        self.lr_multipliers = lr_multipliers

    def key(self, fqn: str) -> tuple[bool, float]:
        """(trained without weight decay, lr multiplier) of the parameter named ``fqn``."""
        exempt = any(fnmatch.fnmatchcase(fqn, pattern) for pattern in self.exclude)
        factors = (f for p, f in self.lr_multipliers.items() if fnmatch.fnmatchcase(fqn, p))
        return exempt, next(factors, 1.0)

    def split(self, part: nn.Module, params: list[nn.Parameter], lr: float) -> list[dict]:
        """``params`` of ``part`` -> one group per (weight decay, lr): the plain group first
        (the LR schedule reports its lr), the others in order of first appearance; ``lr`` is
        the optimizer's base learning rate."""
        fqns = {id(p): _clean(name) for name, p in part.named_parameters()}
        # DTensors and plain tensors in separate groups: foreach and fused steps take one kind
        # (a model may keep some parameters plain under tensor parallel, the hf backend's
        # replicated MoE experts)
        grouped: dict[tuple[bool, float, bool], list[nn.Parameter]] = {}
        for param in params:
            key = (*self.key(fqns[id(param)]), isinstance(param, DTensor))
            grouped.setdefault(key, []).append(param)
        groups = []
        plain_first = sorted(grouped, key=lambda key: key[:2] != (False, 1.0))  # stable
        for exempt, factor, is_dtensor in plain_first:
            members = grouped[(exempt, factor, is_dtensor)]
            group: dict[str, Any] = {"params": members}
            if exempt:
                group["weight_decay"] = 0.0
            if factor != 1.0:
                group["lr"] = lr * factor
            groups.append(group)
        return groups

    def matches(self, model_parts: list[nn.Module]) -> dict[str, dict[str, int]]:
        """Per field, how many parameters (trainable or frozen) each pattern matched; the
        default exclusion's patterns are left out (they cover every model family, so a model
        without biases, say, matches fewer of them)."""
        names = [_clean(name) for part in model_parts for name, _ in part.named_parameters()]

        def count(patterns) -> dict[str, int]:
            return {p: sum(fnmatch.fnmatchcase(n, p) for n in names) for p in patterns}

        added = [p for p in self.exclude if p not in DEFAULT_WEIGHT_DECAY_EXCLUDE]
        return {
            "optimizer.weight_decay_exclude": count(added),
            "optimizer.lr_multipliers": count(self.lr_multipliers),
        }


def _implementation_kwargs(implementation: str) -> dict[str, bool]:
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


@functools.cache
def _fused_supported_devices() -> tuple[str, ...]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return tuple(_get_fused_kernels_supported_devices())


def resolve_optimizer_for_device(optimizer: OptimizerConfig, device_type: str) -> list[str]:
    """Resolve in place the optimizer settings that depend on the run's device: ``fused`` where
    ``device_type`` has no fused kernels becomes ``foreach``, Muon's ``ns_dtype = "auto"``
    becomes the iteration dtype for ``device_type``. Returns what was decided, a line each."""
    lines = []
    if optimizer.implementation == "fused" and device_type not in _fused_supported_devices():
        optimizer.implementation = "foreach"
        lines.append(
            f"optimizer.implementation=fused: no fused kernels on {device_type}; using foreach"
        )
    if optimizer.name == "Muon" and optimizer.muon.ns_dtype == "auto":
        optimizer.muon.ns_dtype = resolve_ns_dtype("auto", device_type)
        lines.append(
            f"optimizer.muon.ns_dtype=auto: Newton-Schulz in {optimizer.muon.ns_dtype} on "
            f"{device_type}"
        )
    return lines


def build_optimizers(
    model_parts: list[nn.Module], optimizer: OptimizerConfig, parallel_dims: ParallelDims | None
) -> OptimizersContainer:
    """One ``optimizer.name`` optimizer per model part over its trainable parameters (Muon:
    a Muon and an AdamW optimizer per part, see :func:`muon_split`)."""
    cfg = optimizer
    kwargs = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        **_implementation_kwargs(cfg.implementation),
    }
    groups = ParamGroups(cfg.weight_decay_exclude, cfg.lr_multipliers)
    if cfg.name == "Muon":
        built = _build_muon(model_parts, cfg, kwargs, parallel_dims, groups)
    else:
        built = OptimizersContainer(
            model_parts,
            *_adam(cfg.name, cfg.state_dtype, kwargs),
            lambda part: groups.split(part, trainable(part), cfg.lr),
        )
    for field, matches in groups.matches(model_parts).items():
        _check_patterns_match(matches, parallel_dims, field)
    return built


def _adam(
    name: str, state_dtype: str, kwargs: dict[str, Any]
) -> tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]:
    """The Adam or AdamW class and its keyword arguments: torch.optim's, or with
    ``optimizer.state_dtype`` other than fp32 the one keeping its moments in that dtype."""
    if state_dtype == "float32":
        return _OPTIMIZERS[name], kwargs
    low = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}
    low.update(decoupled=name == "AdamW", state_dtype=TORCH_DTYPES[state_dtype])
    return AdamWithStateDtype, low


def muon_split(
    model_parts: list[nn.Module], patterns: list[str]
) -> tuple[list[list[nn.Parameter]], list[list[nn.Parameter]], dict[str, int]]:
    """Per part, (Muon's parameters, AdamW's parameters) and how many parameters (trainable
    or frozen) each ``optimizer.muon.adamw_params`` pattern matched: Muon takes the trainable
    2-D weights (LoRA adapters too) and 3-D expert stacks that no pattern names, AdamW the
    rest."""
    matches = dict.fromkeys(patterns, 0)
    muon, adamw = [], []
    for part in model_parts:
        muon.append([])
        adamw.append([])
        for name, p in part.named_parameters():
            fqn = _clean(name)
            hits = [pattern for pattern in patterns if fnmatch.fnmatchcase(fqn, pattern)]
            for pattern in hits:
                matches[pattern] += 1
            if p.requires_grad:
                (muon[-1] if p.ndim in (2, 3) and not hits else adamw[-1]).append(p)
    return muon, adamw, matches


def _build_muon(
    model_parts: list[nn.Module],
    cfg: OptimizerConfig,
    adamw_kwargs: dict[str, Any],
    parallel_dims: ParallelDims | None,
    groups: ParamGroups,
) -> OptimizersContainer:
    m = cfg.muon
    muon, adamw, matches = muon_split(model_parts, m.adamw_params)
    added = {p: count for p, count in matches.items() if p not in DEFAULT_MUON_ADAMW_PARAMS}
    _check_patterns_match(added, parallel_dims, "optimizer.muon.adamw_params")
    adamw_kwargs = {
        **adamw_kwargs,
        "lr": cfg.lr if m.adamw_lr is None else m.adamw_lr,
        "weight_decay": cfg.weight_decay if m.adamw_weight_decay is None else m.adamw_weight_decay,
    }
    if m.ns_dtype not in NS_DTYPES:
        raise ValueError(
            f"optimizer.muon.ns_dtype={m.ns_dtype!r} reached build_optimizers unresolved; "
            "resolve the config for the run's device first (resolve_optimizer_for_device)"
        )
    ns_dtype = m.ns_dtype
    adamw_cls, adamw_kwargs = _adam("AdamW", cfg.state_dtype, adamw_kwargs)
    pairs = []
    for part, muon_params, adamw_params in zip(model_parts, muon, adamw):
        if muon_params:
            pairs.append(
                (
                    part,
                    Muon(
                        groups.split(part, muon_params, cfg.lr),
                        lr=cfg.lr,
                        weight_decay=cfg.weight_decay,
                        momentum=m.momentum,
                        nesterov=m.nesterov,
                        ns_coefficients=tuple(m.ns_coefficients),
                        ns_steps=m.ns_steps,
                        eps=m.eps,
                        adjust_lr=m.adjust_lr,
                        ns_dtype=ns_dtype,
                    ),
                )
            )
        if adamw_params:
            pairs.append(
                (
                    part,
                    adamw_cls(groups.split(part, adamw_params, adamw_kwargs["lr"]), **adamw_kwargs),
                )
            )
    counts = [sum(p.numel() for p in group) for group in (sum(muon, []), sum(adamw, []))]
    logger.info(
        f"optimizer: Muon on {sum(map(len, muon))} weight matrices ({counts[0]:,} values on "
        f"this rank; Newton-Schulz in {ns_dtype}), AdamW on {sum(map(len, adamw))} other "
        f"parameters ({counts[1]:,})"
    )
    return OptimizersContainer.of(model_parts, pairs)


def _check_patterns_match(
    matches: dict[str, int], parallel_dims: ParallelDims | None, field: str
) -> None:
    """Every pattern of ``field`` names a parameter of the model (a pipeline stage sees only
    its own: there the counts are summed over the stages, once, while building)."""
    counts = list(matches.values())
    if parallel_dims is not None and parallel_dims.pp_enabled and counts:
        with unset_fake_temporarily():
            group = parallel_dims.world_mesh["pp"].get_group()
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
            summed = torch.tensor(counts, dtype=torch.int64, device=device)
            dist.all_reduce(summed, group=group)
            counts = summed.tolist()
    for pattern, count in zip(matches, counts):
        if count == 0:
            raise ConfigError(
                f"{field}: {pattern!r} matches no parameter; use names "
                "as in the checkpoint, e.g. 'tok_embeddings.*' or 'layers.*.attention.wo.weight'"
            )


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
