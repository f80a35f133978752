"""Layouts the tests share: the trainer's data-parallel overrides and one process's
ParallelDims."""

from __future__ import annotations

from torchtitan.distributed import ParallelDims

HSDP_2X2 = [
    "--parallelism.data_parallel_replicate_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "2",
]
DDP_2 = [
    "--parallelism.data_parallel_replicate_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "1",
]


def single_process_dims() -> ParallelDims:
    """Every degree 1 (a fresh instance: ParallelDims caches its mesh)."""
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)


def mesh_built(parallel_dims: ParallelDims) -> bool:
    """Whether ``parallel_dims`` has built its world mesh yet (it builds it on first use)."""
    return parallel_dims._world_mesh is not None
