"""Muon over sharded parameters: the momentum of each hidden weight matrix orthogonalised by
a Newton-Schulz iteration, exactly as ``torch.optim.Muon`` does on one device.

Written here: ``torch.optim.Muon`` takes plain 2-D tensors only, and the iteration needs each
whole matrix while FSDP / tensor parallel hold shards. Each matrix (a DTensor) is gathered,
orthogonalised by one rank of its mesh (matrix ``i`` by rank ``i % mesh size``: the work is
spread), and its shards go back by a reduce-scatter of the owner's result with the other
ranks' zeros (exact: x + 0 = x). Matrices are processed one after the other, so a rank holds
at most two whole matrices at a time (the gathered update and the reduce-scatter input).
Plain tensors (one process, or replicated parameters) are orthogonalised where they are.
MoE experts ([experts, rows, cols]) are orthogonalised per expert, batched; a split of the
experts (expert parallel, or FSDP on the expert dim) stays local: only the ranks that hold
the same experts exchange them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torchtitan.tools.cpu_precision import matmul_speed

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_ns_dtype(setting: str, device_type: str) -> str:
    """``optimizer.muon.ns_dtype`` for a run on ``device_type``: "auto" is bfloat16 unless
    this is a CPU that emulates bf16 matmuls (~80x slower than float32 there)."""
    if setting != "auto":
        return setting
    if device_type != "cpu":
        return "bfloat16"
    with unset_fake_temporarily():
        native = matmul_speed(torch.bfloat16).native
    return "bfloat16" if native else "float32"


def newton_schulz(
    update: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on the last two dims (torch.optim.Muon's, whose op
    order a 2-D input follows exactly; a 3-D input is a batch of matrices)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x.div(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x.div(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust: str, shape: torch.Size) -> float:
    """torch.optim.Muon's lr scale for one matrix of ``shape`` (rows, cols)."""
    rows, cols = shape[-2:]
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def _splits_dim0(placement) -> bool:
    return isinstance(placement, Shard) and placement.dim == 0


def _group_size(mesh, dims: list[bool]) -> int:
    """Ranks over the selected mesh dims (those that share one gathered matrix)."""
    return math.prod(size for size, keep in zip(mesh.shape, dims) if keep)


def _group_rank(mesh, dims: list[bool]) -> int:
    """This rank's index among the ranks over the selected mesh dims."""
    rank = 0
    for index, size, keep in zip(mesh.get_coordinate(), mesh.shape, dims):
        if keep:
            rank = rank * size + index
    return rank


class Muon(torch.optim.Optimizer):
    """Muon for hidden weight matrices (2-D, or 3-D stacks of experts), plain or DTensor."""

    def __init__(
        self,
        params,
        lr: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_coefficients: tuple[float, float, float],
        ns_steps: int,
        eps: float,
        adjust_lr: str,
        ns_dtype: str,
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            ns_steps=ns_steps,
            eps=eps,
            adjust_lr=adjust_lr,
            ns_dtype=ns_dtype,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes 2-D or 3-D (experts) weights, got {p.ndim}-D")

    @torch.no_grad()
    def step(self, closure=None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            pending = [p for p in group["params"] if p.grad is not None]
            for index, p in enumerate(pending):
                update = self._momentum_update(p, group)
                ortho = self._orthogonalise(update, index, group)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(ortho, alpha=-adjusted_lr(group["lr"], group["adjust_lr"], p.shape))
        return loss

    def _momentum_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        momentum = group["momentum"]
        buf.lerp_(p.grad, 1 - momentum)
        return p.grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _orthogonalise(self, update: torch.Tensor, index: int, group: dict) -> torch.Tensor:
        def iterate(whole: torch.Tensor) -> torch.Tensor:
            return newton_schulz(
                whole,
                group["ns_coefficients"],
                group["ns_steps"],
                group["eps"],
                NS_DTYPES[group["ns_dtype"]],
            ).to(update.dtype)

        if not isinstance(update, DTensor):
            return iterate(update)
        mesh, placements = update.device_mesh, update.placements
        # a mesh dim that splits the experts (dim 0 of a 3-D stack) keeps its split: each
        # rank orthogonalises its own experts; every other split is gathered
        gathered = [not (update.ndim == 3 and _splits_dim0(p)) for p in placements]
        whole = update.redistribute(
            mesh, [Replicate() if g else p for g, p in zip(gathered, placements)]
        ).to_local()
        if index % _group_size(mesh, gathered) == _group_rank(mesh, gathered):
            result = iterate(whole)
        else:
            result = torch.zeros_like(whole)
        del whole
        summed = [Partial() if g else p for g, p in zip(gathered, placements)]
        partial = DTensor.from_local(result, mesh, summed, run_check=False)
        return partial.redistribute(mesh, placements)
