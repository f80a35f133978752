"""Context parallelism (CP): the ranks of the ``cp`` mesh each hold a slice of every sequence.

The layout of the shards is :mod:`layout`'s (shared with the delta rule).

Attention (:class:`ContextParallelAttention`, the drop-in for the local kernels of
``torchtitan/layers/attention.py``; it keeps the replaced kernel's mask):

- ``allgather``: all-gather K and V (the backward reduce-scatters dK and dV); under the plain
  causal mask each local query chunk runs SDPA against the keys up to its end with a
  lower-right causal bool mask (``S_local x S`` bools per rank and layer, the price of using
  the fused SDPA kernels); under a document or window mask the queries run block by block
  over the visible blocks of all keys.
- ``alltoall``: ring attention. K/V blocks travel around the ring while each rank attends its
  queries to the visible blocks of the one it holds (on the CPU one fused flash-attention call
  per query chunk, which returns the log-sum-exp; elsewhere fp32 block math); partial results
  merge by log-sum-exp.
  The backward recomputes each block, keeps dQ local and passes the dK/dV accumulators around
  the ring behind the blocks; a rank holds at most two K/V blocks (the one in use and the one
  arriving). The shift is an all-to-all with one non-empty split, which torch.compile can
  trace.
- ``ulysses``: all-to-all from sequence-sharded to head-sharded, attention over the full
  sequence on ``H / cp`` heads (causal SDPA, or block by block under a document or window
  mask), all-to-all back (needs ``H % cp == 0``).

Masks follow global positions and the document ids of the whole sequences (the model passes
them unsharded): each rank builds, once per batch, the :class:`BlockPlan` of the blocks its
queries meet; fully masked blocks are skipped, and load balancing is unaffected.

The collectives are ``collectives.py``'s (Gated DeltaNet's state hand-off:
``delta_rule.py``); every collective runs on ``cp_mesh.get_group()`` and works
on gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.context_parallel.collectives import (
    AllGather,
    AllToAll,
    ready,
    ring_shift,
)
from torchtitan.distributed.context_parallel.layout import (
    chunk_ids,
    chunk_length,
    fine_ids,
    num_chunks,
    to_global_order,
    to_rank_major,
)
from torchtitan.layers.attention import (
    LOCAL_KERNELS,
    AttentionKernel,
    MaskSpec,
    chunk_size,
    own_mask,
)
from torchtitan.layers.blockwise_attention import (
    BlockPlan,
    add_sinks,
    block_backward,
    block_forward,
    blockwise_attention,
    build_block_plan,
    fused,
    fused_partial_backward,
    fused_partial_forward,
    merge_blocks,
    sink_grad,
)

RotateMethod = Literal["allgather", "alltoall", "ulysses"]


def check_cp_config(
    seq_len: int,
    cp: int,
    tp: int,
    n_heads: int,
    rotate_method: str,
    load_balancer: str = "headtail",
    seq_len_field: str = "training.seq_len",
) -> None:
    """Raise ValueError (one line) when this CP layout cannot run.

    Under TP the attention sees ``n_heads / tp`` heads and sequence parallel splits each cp
    shard ``tp`` ways, hence the ``tp`` factors.
    """
    if rotate_method not in get_args(RotateMethod):
        raise ValueError(
            f"parallelism.context_parallel_rotate_method must be one of "
            f"{get_args(RotateMethod)}, got {rotate_method!r}"
        )
    divisor = num_chunks(cp, load_balancer) * tp
    if seq_len % divisor != 0:
        raise ValueError(
            f"{seq_len_field} {seq_len} must be divisible by {divisor} (= "
            f"{'2 * ' if load_balancer == 'headtail' else ''}cp {cp} * tp {tp}) for context "
            f"parallel with load_balancer {load_balancer!r}"
        )
    if rotate_method == "ulysses" and n_heads % (cp * tp) != 0:
        raise ValueError(
            f"context_parallel_rotate_method 'ulysses' shards heads: n_heads {n_heads} must be "
            f"divisible by cp {cp} * tp {tp}"
        )


# ---------------------------------------------------------------------------- ring attention
def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    load_balancer: str,
    scale: float,
    plan: BlockPlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, fp32 log-sum-exp ``[B, H, S_local]``)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    per_chunk = q.shape[2] // len(chunk_ids(cp, rank, load_balancer)) // plan.size
    q_ids = fine_ids(cp, rank, load_balancer, per_chunk)
    size = plan.size
    on_fused = fused(q)
    qs = None if on_fused else (q.float() * scale).split(size, dim=2)
    outs: list = [None] * len(q_ids)
    lses: list = [None] * len(q_ids)
    out = lse = None
    kv = torch.stack([k, v])
    for step in range(cp):
        kv_next = ring_shift(kv, group) if step < cp - 1 else None
        k_ids = fine_ids(cp, (rank - step) % cp, load_balancer, per_chunk)
        if on_fused:  # one kernel call per query chunk over the held block's visible keys
            out_b, lse_b = fused_partial_forward(q, kv[0], kv[1], plan, q_ids, k_ids, scale)
            out, lse = merge_blocks(out, lse, out_b.float(), lse_b)
        else:
            ks, vs = (t.float().split(size, dim=2) for t in kv)
            for a, b, mask in plan.pairs(q_ids, k_ids):
                block = block_forward(qs[a], ks[b], vs[b], mask)
                outs[a], lses[a] = merge_blocks(outs[a], lses[a], *block)
        if kv_next is not None:
            kv = kv_next
    if not on_fused:
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    return out.to(q.dtype), lse


def _held_block_grads(q, kv, out, lse, grad_out, plan: BlockPlan, q_ids, k_ids, scale, math, dq):
    """Add the held K/V block's share of dq into the fp32 ``dq``; return its fp32 ``[2, ...]``
    dk/dv. ``math``: the fp32 block-math inputs (pre-scaled q, dout, lse and delta chunks),
    None on the fused kernels."""
    dkv = torch.zeros_like(kv, dtype=torch.float32)
    if math is None:
        dq += fused_partial_backward(
            q, kv[0], kv[1], out, lse, grad_out, plan, q_ids, k_ids, scale, *dkv
        )
        return dkv
    qs, douts, lses, deltas = math
    size = plan.size
    ks, vs = (t.float().split(size, dim=2) for t in kv)
    dqs, dks, dvs = dq.split(size, dim=2), dkv[0].split(size, dim=2), dkv[1].split(size, dim=2)
    for a, b, mask in plan.pairs(q_ids, k_ids):
        dq_ab, dk_ab, dv_ab = block_backward(
            qs[a], ks[b], vs[b], douts[a], lses[a], deltas[a], mask, scale
        )
        dqs[a].add_(dq_ab)
        dks[b].add_(dk_ab)
        dvs[b].add_(dv_ab)
    return dkv


def _ring_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    group: dist.ProcessGroup,
    load_balancer: str,
    scale: float,
    plan: BlockPlan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    per_chunk = q.shape[2] // len(chunk_ids(cp, rank, load_balancer)) // plan.size
    q_ids = fine_ids(cp, rank, load_balancer, per_chunk)
    size = plan.size
    math = None
    if not fused(q):
        dout = grad_out.float()
        delta = (dout * out.float()).sum(-1)
        math = (
            (q.float() * scale).split(size, dim=2),
            dout.split(size, dim=2),
            lse.split(size, dim=2),
            delta.split(size, dim=2),
        )
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = torch.stack([k, v])
    dkv_in_flight = None
    for step in range(cp):
        kv_next = ring_shift(kv, group) if step < cp - 1 else None
        k_ids = fine_ids(cp, (rank - step) % cp, load_balancer, per_chunk)
        dkv = _held_block_grads(q, kv, out, lse, grad_out, plan, q_ids, k_ids, scale, math, dq)
        # The accumulator of the block held now comes from the previous rank, which held this
        # block one step earlier; after cp hops every accumulator is back with its owner.
        if dkv_in_flight is not None:
            dkv += dkv_in_flight
        dkv_in_flight = ring_shift(dkv, group)
        del dkv  # not alive during the next block's temporaries
        if kv_next is not None:
            kv = kv_next
    dk, dv = ready(dkv_in_flight)  # a plain tensor, never an AsyncCollectiveTensor, as grads
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention over the cp group following a :class:`BlockPlan`, with autocast off
    (the trainer may run the forward under autocast): on the CPU's fused flash kernels in
    the input dtype (fp32/bf16), else block math in fp32; partial outputs merge in fp32."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup,
        load_balancer: str,
        scale: float,
        plan: BlockPlan,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, k, v, group, load_balancer, scale, plan)
            if sinks is not None:  # once, on the result over every rank's keys
                out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.layout = group, load_balancer, scale, plan
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            grads = _ring_backward(q, k, v, out, lse, grad_out, *ctx.layout)
            d_sinks = None if sinks is None else sink_grad(out, lse, grad_out, sinks)
        return *grads, None, None, None, None, d_sinks


# ---------------------------------------------------------------------------- the other methods
def _allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    load_balancer: str,
    scale: float,
    plan: BlockPlan | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``plan`` None: the causal mask through SDPA; else the plan's blocks of every key."""
    shards = AllGather.apply(torch.stack([k, v]), group).unbind(0)
    kv = to_global_order(shards, -2, load_balancer)  # [2, B, H, S, D]
    q_ids = chunk_ids(len(shards), dist.get_rank(group), load_balancer)
    size = q.shape[2] // len(q_ids)
    if plan is not None:
        per_chunk = size // plan.size
        fine_q = fine_ids(len(shards), dist.get_rank(group), load_balancer, per_chunk)
        all_ids = list(range(kv.shape[3] // plan.size))
        return blockwise_attention(q, kv[0], kv[1], plan, fine_q, all_ids, scale, sinks)
    outs = []
    for chunk_id, q_chunk in zip(q_ids, q.split(size, dim=2)):
        end = (chunk_id + 1) * size  # keys after this chunk's last query are all masked
        # Lower-right causal: query j (global position end - size + j) sees keys <= that.
        # A plain bool mask, not torch.nn.attention.bias.CausalBias, which fails under
        # TorchDispatchModes such as selective activation checkpointing.
        mask = torch.ones(size, end, dtype=torch.bool, device=q.device).tril(end - size)
        outs.append(
            F.scaled_dot_product_attention(
                q_chunk, kv[0, :, :, :end], kv[1, :, :, :end], attn_mask=mask, scale=scale
            )
        )
    return torch.cat(outs, dim=2)


def _ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    load_balancer: str,
    scale: float,
    plan: BlockPlan | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``plan`` None: causal SDPA over the full sequence; else the plan's blocks. This rank
    attends with head group ``rank`` (its slice of ``sinks``)."""
    cp = dist.get_world_size(group)
    heads = q.shape[1]
    # [3, B, H, S_l, D] -> [cp (head group), 3, B, H/cp, S_l, D] -> sequence-complete head groups
    qkv = torch.stack([q, k, v]).unflatten(2, (cp, heads // cp)).movedim(2, 0)
    qkv = to_global_order(AllToAll.apply(qkv, group).unbind(0), -2, load_balancer)
    if plan is None:
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True, scale=scale)
    else:
        all_ids = list(range(qkv.shape[3] // plan.size))
        if sinks is not None:
            sinks = sinks.unflatten(0, (cp, heads // cp))[dist.get_rank(group)]
        out = blockwise_attention(qkv[0], qkv[1], qkv[2], plan, all_ids, all_ids, scale, sinks)
    # back to [cp (head group), B, H/cp, S_l, D] -> [B, H, S_l, D]
    out = AllToAll.apply(to_rank_major(out, -2, cp, load_balancer), group)
    return out.movedim(0, 1).flatten(1, 2)


# ---------------------------------------------------------------------------- module + apply
class ContextParallelAttention(AttentionKernel):
    """Attention under ``spec`` over sequences sharded across ``cp_mesh``.

    ``forward(q, k, v, mask=..., scale=None)`` takes this rank's shard ``[batch, heads,
    S_local, head_dim]`` (cut by :func:`cp_shard` with the same ``load_balancer``; k/v with as
    many heads as q) and returns this rank's shard of the output. The global length is
    ``S_local * cp``; ``scale`` is the softmax scale, by default ``1 / sqrt(head_dim)``.
    ``mask`` is what :meth:`prepare` built from the document ids of the whole sequences
    (global positions): a :class:`BlockPlan` of the blocks this rank computes, or None for
    the plain causal mask of ``allgather`` and ``ulysses`` (SDPA kernels).
    """

    def __init__(
        self,
        cp_mesh: DeviceMesh,
        rotate_method: str = "allgather",
        load_balancer: str = "headtail",
        spec: MaskSpec = MaskSpec(),
    ) -> None:
        super().__init__()
        if rotate_method not in get_args(RotateMethod):
            raise ValueError(
                f"unknown context-parallel rotate method {rotate_method!r}; "
                f"expected one of {get_args(RotateMethod)}"
            )
        num_chunks(cp_mesh.size(), load_balancer)  # validates the name
        self.cp_mesh = cp_mesh
        self.rotate_method = rotate_method
        self.load_balancer = load_balancer
        self.spec = spec

    def prepare(self, document_ids: torch.Tensor | None, device: torch.device) -> BlockPlan | None:
        if document_ids is None or (self.spec.causal_only and self.rotate_method != "alltoall"):
            return None  # causal SDPA, or a plan built from the shapes in forward
        docs = document_ids if self.spec.block_causal else None
        return self._plan(document_ids.shape[1] // self.cp_mesh.size(), docs, device)

    def _plan(
        self, local_len: int, document_ids: torch.Tensor | None, device: torch.device
    ) -> BlockPlan:
        """The blocks this rank computes: its queries (all of them under ulysses) against
        every key, in chunks that divide the load balancer's chunks."""
        cp, rank = self.cp_mesh.size(), self.cp_mesh.get_local_rank()
        chunk = chunk_length(local_len * cp, cp, self.load_balancer)
        size = chunk_size(chunk)
        q_ids = (
            list(range(local_len * cp // size))
            if self.rotate_method == "ulysses"
            else fine_ids(cp, rank, self.load_balancer, chunk // size)
        )
        k_ids = list(range(local_len * cp // size))
        return build_block_plan(q_ids, k_ids, size, document_ids, self.spec.sliding_window, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: BlockPlan | None = None,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not q.shape == k.shape == v.shape:
            raise ValueError(
                f"context-parallel attention needs q, k, v of one shape [batch, heads, seq, "
                f"head_dim] (expand KV heads first); got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        mask = own_mask(mask, self.spec)
        cp = self.cp_mesh.size()
        chunk_length(q.shape[2] * cp, cp, self.load_balancer)
        group = self.cp_mesh.get_group()
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        # sinks need the log-sum-exp: the block kernels' paths, never plain SDPA
        if mask is None and (
            self.rotate_method == "alltoall" or not self.spec.causal_only or sinks is not None
        ):
            mask = self._plan(q.shape[2], None, q.device)
        if self.rotate_method == "allgather":
            return _allgather_attention(q, k, v, group, self.load_balancer, scale, mask, sinks)
        if self.rotate_method == "alltoall":
            return _RingAttention.apply(q, k, v, group, self.load_balancer, scale, mask, sinks)
        if q.shape[1] % cp != 0:
            raise ValueError(
                f"ulysses context parallel needs heads ({q.shape[1]}) divisible by cp ({cp})"
            )
        return _ulysses_attention(q, k, v, group, self.load_balancer, scale, mask, sinks)

    def extra_repr(self) -> str:
        return (
            f"cp={self.cp_mesh.size()}, rotate_method={self.rotate_method!r}, "
            f"load_balancer={self.load_balancer!r}, block_causal={self.spec.block_causal}, "
            f"sliding_window={self.spec.sliding_window}"
        )


def has_local_attention(model: nn.Module) -> bool:
    """Whether ``model`` computes attention through a local ``inner_attention`` kernel."""
    return any(
        isinstance(getattr(m, "inner_attention", None), LOCAL_KERNELS) for m in model.modules()
    )


def apply_cp(
    model: nn.Module,
    cp_mesh: DeviceMesh,
    rotate_method: str = "allgather",
    load_balancer: str = "headtail",
) -> int:
    """Replace every ``inner_attention`` local kernel (SDPA or FlexAttention) in ``model`` with
    a :class:`ContextParallelAttention` of the same mask; returns how many were replaced (at
    least one)."""
    owners = [
        m for m in model.modules() if isinstance(getattr(m, "inner_attention", None), LOCAL_KERNELS)
    ]
    if not owners:
        raise ValueError(
            "context parallel found no `inner_attention` local attention module to replace; the "
            "model must compute attention through torchtitan.layers.attention"
        )
    for owner in owners:
        spec = owner.inner_attention.spec
        owner.inner_attention = ContextParallelAttention(
            cp_mesh, rotate_method, load_balancer, spec
        )
    return len(owners)
