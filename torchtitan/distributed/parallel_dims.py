"""ParallelDims: validated parallel degrees and the lazily built world mesh.

Nothing else in the code base builds a DeviceMesh: callers read named views with
``parallel_dims.world_mesh[name]``.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from torchtitan.config import FaultToleranceConfig, ParallelismConfig

DEVICE_TYPE_ENV = "TORCHTITAN_DEVICE_TYPE"

# Which degree to raise when a caller asks for a view that this layout does not have.
_VIEW_HINTS = {
    "pp": "parallelism.pipeline_parallel_degree > 1",
    "dp_replicate": "parallelism.data_parallel_replicate_degree > 1",
    "dp_shard": "parallelism.data_parallel_shard_degree > 1",
    "cp": "parallelism.context_parallel_degree > 1",
    "tp": "parallelism.tensor_parallel_degree > 1",
    "dp": "data_parallel_shard_degree or data_parallel_replicate_degree > 1",
    "dp_shard_cp": "data_parallel_shard_degree or context_parallel_degree > 1",
    "dp_cp": "a data-parallel or context-parallel degree > 1",
    "ep": "parallelism.expert_parallel_degree > 1",
    "etp": (
        "parallelism.expert_tensor_parallel_degree = tensor_parallel_degree > 1 "
        "with expert parallel"
    ),
    "efsdp": "parallelism.expert_parallel_degree > 1",
}


def default_device_type() -> str:
    """cuda when available, else cpu; the env var TORCHTITAN_DEVICE_TYPE overrides (tests
    force cpu/gloo, the memory estimator builds cpu meshes on GPU hosts)."""
    forced = os.environ.get(DEVICE_TYPE_ENV)
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


class WorldMesh:
    """The world DeviceMesh plus its named views. ``world_mesh[name]`` returns a real
    DeviceMesh; asking for a view this layout lacks names the degree to set."""

    def __init__(self, root: DeviceMesh, views: dict[str, DeviceMesh]) -> None:
        self.root = root
        self._views = views

    @property
    def device_type(self) -> str:
        return self.root.device_type

    @property
    def view_names(self) -> list[str]:
        return list(self._views)

    def __contains__(self, name: str) -> bool:
        return name in self._views

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        names = (name,) if isinstance(name, str) else tuple(name)
        for n in names:
            if n not in self._views:
                hint = _VIEW_HINTS.get(n, "a layout that has it")
                raise KeyError(
                    f"world_mesh has no {n!r} view in this layout (views: "
                    f"{', '.join(self._views)}); it exists with {hint}"
                )
        if len(names) == 1:
            return self._views[names[0]]
        with warnings.catch_warnings():
            # A multi-dim view that includes a flattened dim (HSDP's (dp_replicate,
            # dp_shard_cp)) still has to be sliced from the root mesh.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.root[names]

    def size(self) -> int:
        return self.root.size()

    def get_rank(self) -> int:
        return self.root.get_rank()

    def __repr__(self) -> str:
        return f"WorldMesh({self.root}, views={list(self._views)})"


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    etp: int = 1
    device_type: str | None = None
    replica_id: int = 0
    """Fault tolerance: this job's replica group (the groups are separate jobs, each with
    this layout inside) and the number of groups; both only split the data."""
    replica_groups: int = 1
    cp_rotate_method: str = "allgather"
    """How context parallel exchanges keys and values (``allgather``, ``alltoall`` = the
    ring, ``ulysses``) and how it balances the causal work over its ranks (``headtail``,
    ``none``): read here by everything that shards, attends or estimates under CP."""
    cp_load_balancer: str = "headtail"
    _world_mesh: WorldMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------ validation
    def _degrees(self) -> str:
        return (
            f"(dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, cp={self.cp}, "
            f"tp={self.tp}, pp={self.pp}, ep={self.ep}, etp={self.etp}, "
            f"world_size={self.world_size})"
        )

    def _fail(self, rule: str) -> None:
        raise ValueError(f"invalid parallel degrees {self._degrees()}: {rule}")

    def _validate(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep", "etp", "world_size"):
            if getattr(self, name) < 1:
                self._fail(f"{name} must be >= 1")
        if self.dp_shard == -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % others != 0:
                self._fail(
                    f"cannot infer dp_shard: world_size {self.world_size} is not divisible by "
                    f"dp_replicate*cp*tp*pp = {others}; change the degrees or the process count"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            self._fail("dp_shard must be -1 (infer) or >= 1")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            self._fail(
                f"dp_replicate*dp_shard*cp*tp*pp = {product} must equal world_size "
                f"{self.world_size}; set data_parallel_shard_degree = -1 to infer it, or "
                "launch that many processes"
            )
        if self.etp not in (1, self.tp):
            self._fail("etp (expert tensor parallel) must be 1 or equal to tp")
        if self.ep > 1:
            if self.ep % self.cp != 0:
                self._fail("ep must be a multiple of cp (expert parallel borrows all of cp)")
            if (self.dp_shard * self.cp) % self.ep != 0:
                self._fail(
                    "dp_shard*cp must be divisible by ep (expert parallel borrows ranks "
                    "from dp_shard*cp)"
                )

    # ------------------------------------------------------------------ flags and sizes
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ring_cp(self) -> bool:
        """Context parallel passes key/value shards around a ring (one partial attention
        output per ring step)."""
        return self.cp_enabled and self.cp_rotate_method == "alltoall"

    @property
    def dp_cp_enabled(self) -> bool:
        return self.dp_enabled or self.cp_enabled

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_enabled or self.cp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def dp_degree(self) -> int:
        """Data-parallel degree for data loading (replicate x shard)."""
        return self.dp_replicate * self.dp_shard

    @cached_property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    @cached_property
    def seq_len_divisor(self) -> int:
        """Sequence parallel needs seq_len % tp == 0; CP load balancing needs % (2*cp)."""
        return self.tp * 2 * self.cp

    # ------------------------------------------------------------------ mesh
    @property
    def world_mesh(self) -> WorldMesh:
        """Built on first access (needs an initialised default process group)."""
        if self._world_mesh is None:
            self._world_mesh = self._build_mesh()
        return self._world_mesh

    def _mesh_dims(self) -> list[tuple[str, int]]:
        if self.ep > 1:
            dims = [
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("dp_shard_mod_ep", self.dp_shard * self.cp // self.ep),
                ("dp_shard_in_ep", self.ep // self.cp),
                ("cp", self.cp),
                ("tp", self.tp),
            ]
            # dp_shard_mod_ep stays even at size 1 so experts still get an FSDP wrapper
            # (mixed precision, gradient reduction dtype).
            return [(n, d) for n, d in dims if d > 1 or n == "dp_shard_mod_ep"]
        dims = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
        ]
        return [(n, d) for n, d in dims if d > 1]

    def first_rank_at(self, dim: str, index: int) -> int:
        """The lowest global rank whose coordinate along mesh dim ``dim`` is ``index``
        (the world mesh is row-major over ``_mesh_dims``). Needs no process group."""
        names = [n for n, _ in self._mesh_dims()]
        if dim not in names:
            return 0
        stride = math.prod(d for _, d in self._mesh_dims()[names.index(dim) + 1 :])
        return index * stride

    def _flattened_views(self, present: set[str]) -> dict[str, tuple[str, ...]]:
        if self.ep > 1:
            shard = ("dp_shard_mod_ep", "dp_shard_in_ep")
            groups = {
                "dp": ("dp_replicate",) + shard,
                "dp_shard_cp": shard + ("cp",),
                "dp_cp": ("dp_replicate",) + shard + ("cp",),
                "ep": ("dp_shard_in_ep", "cp"),
                "efsdp": ("dp_shard_mod_ep",),
            }
            if self.etp > 1:
                groups["etp"] = ("tp",)
        else:
            groups = {
                "dp": ("dp_replicate", "dp_shard"),
                "dp_shard_cp": ("dp_shard", "cp"),
                "dp_cp": ("dp_replicate", "dp_shard", "cp"),
            }
        return {
            name: tuple(d for d in dims if d in present)
            for name, dims in groups.items()
            if any(d in present for d in dims)
        }

    def _build_mesh(self) -> WorldMesh:
        device_type = self.device_type or default_device_type()
        dims = self._mesh_dims() or [("world", 1)]
        names = tuple(n for n, _ in dims)
        root = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        views: dict[str, DeviceMesh] = {n: root[n] for n in names if n != "world"}
        for flat_name, parts in self._flattened_views(set(names)).items():
            views[flat_name] = root[parts]._flatten(flat_name)
        return WorldMesh(root, views)

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh handed to ``fully_shard``: 1-D for pure FSDP, 2-D (replicate, shard)
        only for HSDP (a 2-D mesh with a size-1 replicate axis would silently put FSDP2 on
        its slower HSDP path). None when parameters are not sharded."""
        if not self.fsdp_enabled:
            return None
        if self.dp_replicate_enabled:
            return self.world_mesh[("dp_replicate", "dp_shard_cp")]
        return self.world_mesh["dp_shard_cp"]

    def data_layout(self) -> tuple[int, int]:
        """(this rank's data rank, the number of data ranks) of the training stream: the
        dp ranks of this job, and under fault tolerance those of every replica group."""
        rank, degree = 0, 1
        if self.dp_enabled:
            dp_mesh = self.world_mesh["dp"]
            rank, degree = dp_mesh.get_local_rank(), dp_mesh.size()
        return self.replica_id * degree + rank, self.replica_groups * degree

    def describe(self) -> str:
        replicas = (
            f", replica group {self.replica_id} of {self.replica_groups}"
            if self.replica_groups > 1
            else ""
        )
        return self._degrees() + replicas


def parallel_dims_from_config(
    parallelism: ParallelismConfig, fault_tolerance: FaultToleranceConfig, world_size: int
) -> ParallelDims:
    """The layout of the ``[parallelism]`` degrees on ``world_size`` processes (under fault
    tolerance, one replica group of ``fault_tolerance.group_size``)."""
    p, ft = parallelism, fault_tolerance
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
        world_size=world_size,
        replica_id=ft.replica_id if ft.enable else 0,
        replica_groups=ft.group_size if ft.enable else 1,
        cp_rotate_method=p.context_parallel_rotate_method,
        cp_load_balancer=p.context_parallel_load_balancer,
    )
