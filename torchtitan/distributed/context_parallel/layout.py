"""The context-parallel layout, shared by the attention and the delta rule.

A sequence of length ``S`` is cut into equal chunks. ``"headtail"`` cuts ``2 * cp``
chunks and gives rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``, so every rank does the same
amount of causal-attention work; ``"none"`` cuts ``cp`` chunks and gives rank ``r`` chunk ``r``.
Everything below (batch sharding, RoPE positions, attention masks) follows from that one rule,
:func:`chunk_ids`. The attention therefore needs no per-step state: it reads the global length
as ``S_local * cp`` and its own chunks from its cp rank, which must match how the batch was cut
(:func:`shard_batch_for_cp` with the same ``load_balancer``).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch.distributed.device_mesh import DeviceMesh

LoadBalancer = Literal["headtail", "none"]


def num_chunks(cp: int, load_balancer: str) -> int:
    if load_balancer not in get_args(LoadBalancer):
        raise ValueError(
            f"unknown context-parallel load balancer {load_balancer!r}; "
            f"expected one of {get_args(LoadBalancer)}"
        )
    return 2 * cp if load_balancer == "headtail" else cp


def chunk_ids(cp: int, rank: int, load_balancer: str) -> list[int]:
    """The global chunk indices cp rank ``rank`` holds, in local order."""
    if num_chunks(cp, load_balancer) == cp:
        return [rank]
    return [rank, 2 * cp - 1 - rank]


def rank_major_chunks(cp: int, load_balancer: str) -> list[int]:
    """Global chunk ids in the order they appear when every rank's shard is concatenated."""
    return [c for r in range(cp) for c in chunk_ids(cp, r, load_balancer)]


def fine_ids(cp: int, rank: int, load_balancer: str, per_chunk: int) -> list[int]:
    """The rank's chunks in units of ``1 / per_chunk`` of a chunk (the blocks of a
    :class:`BlockPlan`), in local order."""
    return [c * per_chunk + i for c in chunk_ids(cp, rank, load_balancer) for i in range(per_chunk)]


def chunk_length(seq_len: int, cp: int, load_balancer: str) -> int:
    n = num_chunks(cp, load_balancer)
    if seq_len % n != 0:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {n}, the number of chunks that "
            f"context parallel (cp={cp}, load_balancer={load_balancer!r}) cuts it into"
        )
    return seq_len // n


def cp_shard(
    tensor: torch.Tensor, seq_dim: int, cp_mesh: DeviceMesh, load_balancer: str = "headtail"
) -> torch.Tensor:
    """This rank's slice of ``tensor`` along ``seq_dim`` (contiguous)."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    size = chunk_length(tensor.shape[seq_dim], cp, load_balancer)
    chunks = tensor.split(size, dim=seq_dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank, load_balancer)], dim=seq_dim)


def cp_positions(
    seq_len: int,
    cp_mesh: DeviceMesh,
    load_balancer: str = "headtail",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions ``[S_local]`` (int64) of this rank's tokens, for RoPE."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    size = chunk_length(seq_len, cp, load_balancer)
    return torch.cat(
        [
            torch.arange(i * size, (i + 1) * size, device=device)
            for i in chunk_ids(cp, rank, load_balancer)
        ]
    )


def shard_batch_for_cp(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    cp_mesh: DeviceMesh,
    load_balancer: str = "headtail",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``inputs``/``labels`` ``[batch, seq]`` -> this rank's ``(inputs, labels, positions)``.

    Labels are already shifted by the data loader (``labels[:, p]`` is the target of token
    ``p``), so they are cut exactly like the inputs.
    """
    seq_len = inputs.shape[1]
    return (
        cp_shard(inputs, 1, cp_mesh, load_balancer),
        cp_shard(labels, 1, cp_mesh, load_balancer),
        cp_positions(seq_len, cp_mesh, load_balancer, inputs.device),
    )


def to_global_order(shards: list[torch.Tensor], seq_dim: int, load_balancer: str) -> torch.Tensor:
    """Every cp rank's shard, in rank order -> the full sequence."""
    cp = len(shards)
    order = rank_major_chunks(cp, load_balancer)
    chunks = [c for shard in shards for c in shard.chunk(len(order) // cp, dim=seq_dim)]
    by_id = dict(zip(order, chunks))
    return torch.cat([by_id[i] for i in range(len(order))], dim=seq_dim)


def to_rank_major(x: torch.Tensor, seq_dim: int, cp: int, load_balancer: str) -> torch.Tensor:
    """The full sequence -> ``[cp, *x.shape with seq / cp]``, rank r's shard at index r."""
    chunks = x.chunk(num_chunks(cp, load_balancer), dim=seq_dim)
    return torch.stack(
        [
            torch.cat([chunks[i] for i in chunk_ids(cp, r, load_balancer)], dim=seq_dim)
            for r in range(cp)
        ]
    )
