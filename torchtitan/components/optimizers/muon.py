"""Muon over sharded parameters: the momentum of each hidden weight matrix orthogonalised by
a Newton-Schulz iteration, exactly as ``torch.optim.Muon`` does on one device.

Written here: ``torch.optim.Muon`` takes plain 2-D tensors only, and the iteration needs each
whole matrix while FSDP / tensor parallel hold shards. The matrices cut over one mesh dim go
in rounds of as many matrices as that dim has ranks: one all-to-all hands each rank the
blocks of the one matrix it orthogonalises, one all-to-all hands the results' blocks back
(the work is spread, each value crosses the network once each way). Rounds overlap: the next
round's gather and the last round's return run while a rank iterates, so a rank holds at
most three whole matrices at once. A second cut of the same matrix (TP under FSDP x TP) is
gathered first and its ranks repeat the work. Plain tensors (one process, replicated
parameters) are orthogonalised where they are. MoE experts ([experts, rows, cols]) are
orthogonalised per expert, batched; a split of the experts (expert parallel, or FSDP on the
expert dim) stays local.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan.tools.cpu_precision import low_precision_native

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_ns_dtype(setting: str, device_type: str) -> str:
    """``optimizer.muon.ns_dtype`` for a run on ``device_type``: "auto" is bfloat16 unless
    the run is on a CPU that emulates bf16 matmuls (~80x slower than float32 there)."""
    if setting != "auto":
        return setting
    return "bfloat16" if low_precision_native(torch.bfloat16, device_type) else "float32"


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


def _chunk_sizes(length: int, parts: int) -> list[int]:
    """``length`` split into ``parts`` the way DTensor's ``Shard`` splits it (torch.chunk:
    chunks of ceil(length / parts), a shorter last one, then empty ones)."""
    size = -(-length // parts)
    return [max(0, min(length, (i + 1) * size) - min(length, i * size)) for i in range(parts)]


@dataclass
class _Spread:
    """How one sharded update reaches the rank that orthogonalises it: its blocks along
    tensor dim ``dim`` over mesh dim ``mesh_dim`` go to that rank; any other split that cuts
    the matrix is gathered first (by DTensor), and a split of the experts stays."""

    param: DTensor  # its update (momentum, Nesterov) has the same layout
    target: tuple  # the placements with only ``mesh_dim`` still cutting a matrix
    mesh_dim: int
    dim: int

    @property
    def width(self) -> int:
        return self.param.device_mesh.size(self.mesh_dim)

    def sizes(self) -> list[int]:
        """Each rank's extent along ``dim`` (in rank order of ``mesh_dim``)."""
        return _chunk_sizes(self.param.size(self.dim), self.width)

    def block_shape(self, rank: int) -> list[int]:
        """The shape of ``rank``'s block (ranks of ``mesh_dim`` differ only along ``dim``)."""
        shape = list(self.param.shape)
        if self.param.ndim == 3:  # the experts this rank holds
            shape[0] = self.param.to_local().size(0)
        shape[self.dim] = self.sizes()[rank]
        return shape

    def local_block(self, update: DTensor) -> torch.Tensor:
        if self.target == tuple(update.placements):
            return update.to_local()
        return update.redistribute(update.device_mesh, self.target).to_local()

    def restore(self, block: torch.Tensor) -> torch.Tensor:
        """This rank's block of the orthogonalised update, in the update's own layout."""
        u = self.param
        out = DTensor.from_local(
            block, u.device_mesh, self.target, run_check=False, shape=u.shape, stride=u.stride()
        )
        if self.target == tuple(u.placements):
            return out
        return out.redistribute(u.device_mesh, u.placements)


def _spread(param: DTensor) -> _Spread | None:
    """The exchange plan of a sharded parameter's update; None where this rank holds whole
    matrices (replicated, or only the experts split)."""
    placements = tuple(param.placements)
    cuts = [
        i
        for i, p in enumerate(placements)
        # a cut: Shard, or the _StridedShard that FSDP puts over a TP shard of the same dim
        if not (p.is_replicate() or p.is_partial()) and not (param.ndim == 3 and p.dim == 0)
    ]
    if not cuts:
        return None
    # the work is spread over one cutting mesh dim, a plain Shard first (no re-layout), the
    # largest next; the other cuts are gathered, and their ranks repeat the same work
    spread = max(cuts, key=lambda i: (type(placements[i]) is Shard, param.device_mesh.size(i)))
    dim = placements[spread].dim
    target = tuple(
        (p if type(p) is Shard else Shard(dim)) if i == spread else Replicate() if i in cuts else p
        for i, p in enumerate(placements)
    )
    return _Spread(param, target, spread, dim)


def _rounds(spreads: list[_Spread], width: int) -> list[list[_Spread]]:
    """Rounds of ``width`` matrices, the i-th of a round orthogonalised by rank i; largest
    first, so that one round's matrices are alike and no rank waits long for another. The
    order depends on global shapes only: every rank forms the same rounds."""
    ordered = sorted(spreads, key=lambda plan: -plan.param.numel())
    return [ordered[i : i + width] for i in range(0, len(ordered), width)]


@dataclass
class _Exchange:
    """One all-to-all in flight (its buffers stay referenced until it is done)."""

    work: Any
    received: torch.Tensor
    sizes: list[int]
    sent: torch.Tensor


def _all_to_all(
    send: list[torch.Tensor], receive: list[int], group, like: torch.Tensor
) -> _Exchange:
    """Send ``send[r]`` to rank r of ``group`` and receive ``receive[r]`` values from it."""
    sent = torch.cat([t.reshape(-1) for t in send])
    received = like.new_empty(sum(receive))
    work = dist.all_to_all_single(
        received, sent, receive, [t.numel() for t in send], group=group, async_op=True
    )
    return _Exchange(work, received, receive, sent)


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
            self._step_group([p for p in group["params"] if p.grad is not None], group)
        return loss

    def _momentum_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        momentum = group["momentum"]
        buf.lerp_(p.grad, 1 - momentum)
        return p.grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _step_group(self, params: list[torch.Tensor], group: dict) -> None:
        """Update every parameter by its orthogonalised momentum. Each update exists from
        just before its matrix is sent (or iterated) until it is applied."""

        def iterate(whole: torch.Tensor) -> torch.Tensor:
            return newton_schulz(
                whole,
                group["ns_coefficients"],
                group["ns_steps"],
                group["eps"],
                NS_DTYPES[group["ns_dtype"]],
            ).to(whole.dtype)

        def apply(p: torch.Tensor, ortho: torch.Tensor) -> None:
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(ortho, alpha=-adjusted_lr(group["lr"], group["adjust_lr"], p.shape))

        exchanged: dict[tuple, list[_Spread]] = {}
        for p in params:
            plan = _spread(p) if isinstance(p, DTensor) else None
            if plan is not None:
                exchanged.setdefault((p.device_mesh, plan.mesh_dim, p.dtype), []).append(plan)
                continue
            update = self._momentum_update(p, group)
            if isinstance(update, DTensor):  # whole matrices here (replicated, or experts)
                ortho = DTensor.from_local(
                    iterate(update.to_local()),
                    update.device_mesh,
                    update.placements,
                    run_check=False,
                    shape=update.shape,
                    stride=update.stride(),
                )
            else:
                ortho = iterate(update)
            apply(p, ortho)
        for (mesh, mesh_dim, _), spreads in exchanged.items():
            _exchange_and_iterate(
                spreads, mesh, mesh_dim, iterate, lambda p: self._momentum_update(p, group), apply
            )


def _exchange_and_iterate(
    spreads: list[_Spread],
    mesh,
    mesh_dim: int,
    iterate: Callable[[torch.Tensor], torch.Tensor],
    update_of: Callable[[DTensor], DTensor],
    apply: Callable[[DTensor, DTensor], None],
) -> None:
    """Orthogonalise the updates of parameters cut over one mesh dim and apply them: per
    round of as many matrices as ranks, one all-to-all brings each rank the blocks of its
    matrix and one brings the results' blocks back. The next round's gather is in flight
    while a rank iterates, and the previous round's return too: at a rank's peak, the whole
    matrix it iterates, the next one received, the last result it sends back, and its own
    blocks of the next and the last round (about one whole matrix each: five in all, of the
    largest size, since rounds go largest first), besides the iteration's temporaries."""
    group = mesh.get_group(mesh_dim)
    rank, width = mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim)
    rounds = _rounds(spreads, width)
    like = spreads[0].param.to_local()

    def gather(matrices: list[_Spread]) -> _Exchange:
        send = [plan.local_block(update_of(plan.param)) for plan in matrices]
        send += [like.new_empty(0)] * (width - len(matrices))
        receive = [0] * width
        if rank < len(matrices):
            receive = [math.prod(matrices[rank].block_shape(r)) for r in range(width)]
        return _all_to_all(send, receive, group, like)

    def give_back(matrices: list[_Spread], ortho: torch.Tensor | None) -> _Exchange:
        send = [like.new_empty(0)] * width
        if ortho is not None:
            mine = matrices[rank]
            send = list(ortho.split(mine.sizes(), dim=mine.dim))
        receive = [math.prod(plan.block_shape(rank)) for plan in matrices]
        return _all_to_all(send, receive + [0] * (width - len(matrices)), group, like)

    def finish(matrices: list[_Spread], back: _Exchange) -> None:
        back.work.wait()
        for plan, piece in zip(matrices, back.received.split(back.sizes)):
            apply(plan.param, plan.restore(piece.view(plan.block_shape(rank))))

    incoming = gather(rounds[0])
    returning: tuple[list[_Spread], _Exchange] | None = None
    for number, matrices in enumerate(rounds):
        arrived = incoming
        if number + 1 < len(rounds):
            incoming = gather(rounds[number + 1])
        arrived.work.wait()
        whole = None
        if rank < len(matrices):
            mine = matrices[rank]
            pieces = arrived.received.split(arrived.sizes)
            whole = torch.cat(
                [piece.view(mine.block_shape(r)) for r, piece in enumerate(pieces)], dim=mine.dim
            )
            del pieces
        del arrived  # the received blocks, now in ``whole``
        ortho = None if whole is None else iterate(whole)
        del whole
        back = give_back(matrices, ortho)
        del ortho
        if returning is not None:
            finish(*returning)
        returning = (matrices, back)
    finish(*returning)
