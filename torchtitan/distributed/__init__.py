from torchtitan.distributed.parallel_dims import ParallelDims, WorldMesh

__all__ = ["ParallelDims", "WorldMesh"]
