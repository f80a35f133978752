"""The collectives of context parallelism as autograd functions, on the ``cp`` group (gloo
and NCCL alike): all-gather with a reduce-scatter backward, all-to-all, and the ring shift
that torch.compile can trace."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class AllGather(torch.autograd.Function):
    """``x`` -> ``[cp, *x.shape]``, every rank's ``x`` in rank order. The backward
    reduce-scatters (sums) the gradients: each rank's keys were used by every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        # [1, ...] pieces concatenated on dim 0 (gloo rejects the stacked form)
        out = x.new_empty((dist.get_world_size(group), *x.shape))
        dist.all_gather_single(out, x.unsqueeze(0).contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.new_empty((1, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out.squeeze(0), None


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 (size cp): rank r's ``x[j]`` goes to rank j, which
    stores it at ``out[r]``. With equal splits this is its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_to_all(grad, ctx.group), None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def ring_shift(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``x`` to the next rank of the ring; return the previous rank's ``x``.

    An all-to-all with one non-empty split (NCCL and gloo turn it into one send and one
    receive) rather than P2P ops, which torch.compile cannot trace. The result is an
    AsyncCollectiveTensor: the transfer overlaps whatever runs before its first use.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return x
    rank = dist.get_rank(group)
    send, recv = [0] * size, [0] * size
    send[(rank + 1) % size] = recv[(rank - 1) % size] = x.numel()
    return funcol.all_to_all_single(x.reshape(-1), recv, send, group).view(x.shape)


def ready(x: torch.Tensor) -> torch.Tensor:
    """Wait for a :func:`ring_shift` result (under torch.compile it is a plain tensor)."""
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


class SumOverRanks(torch.autograd.Function):
    """``x`` summed over the group, for a loss every rank then computes whole from the sum
    (DPO's per-sequence log-probs under context parallel). The backward passes the gradient
    through unchanged: each rank's parameters get the share of its own ``x``, and the
    gradient reduction over the cp ranks adds the shares."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
