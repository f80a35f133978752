import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.launcher import run_probe
from tests.layouts import mesh_built
from torchtitan.distributed import ParallelDims


def dims(world_size, dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1):
    return ParallelDims(
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        cp=cp,
        tp=tp,
        pp=pp,
        ep=ep,
        etp=etp,
        world_size=world_size,
        device_type="cpu",
    )


@pytest.fixture
def fake_world():
    """A fake process group of the requested size (no real communication)."""

    def start(world_size, rank=0):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs, rule",
    [
        (dict(world_size=8, dp_replicate=0), "dp_replicate must be >= 1"),
        (dict(world_size=8, tp=0), "tp must be >= 1"),
        (dict(world_size=8, dp_shard=0), "dp_shard must be -1"),
        (dict(world_size=8, tp=3), "cannot infer dp_shard"),
        (dict(world_size=8, dp_shard=2, tp=2), "must equal world_size 8"),
        (dict(world_size=8, tp=2, etp=4), "etp (expert tensor parallel) must be 1 or equal to tp"),
        (dict(world_size=8, dp_shard=2, cp=4, ep=2), "ep must be a multiple of cp"),
        (dict(world_size=8, dp_shard=2, tp=4, ep=4), "dp_shard*cp must be divisible by ep"),
    ],
)
def test_validation_rules(kwargs, rule):
    with pytest.raises(ValueError) as e:
        dims(**kwargs)
    message = str(e.value)
    assert rule in message
    assert "dp_replicate=" in message and "world_size=" in message  # lists all degrees


def test_dp_shard_inference_and_derived_sizes():
    pd = dims(16, dp_replicate=2, cp=2, tp=2)
    assert pd.dp_shard == 2
    assert pd.non_data_parallel_size == 4
    assert pd.seq_len_divisor == 2 * 2 * 2
    assert pd.dp_degree == 4
    assert pd.fsdp_enabled and pd.dp_cp_enabled and pd.tp_enabled and not pd.pp_enabled


def test_ep_borrowing_layouts_are_valid():
    assert dims(4, ep=2).dp_shard == 4
    assert dims(8, dp_shard=4, cp=2, ep=4).ep_enabled  # ep borrows all of cp and part of dp_shard
    assert dims(8, dp_shard=4, tp=2, ep=2, etp=2).etp_enabled


def test_is_lazy_without_process_group():
    assert not dist.is_initialized()
    pd = dims(8, tp=2)
    assert not mesh_built(pd)
    assert pd.seq_len_divisor == 4  # properties need no process group


LAYOUTS = [
    # (world, kwargs, root mesh dims, {view: size})
    (1, {}, ("world",), {}),
    (2, {}, ("dp_shard",), {"dp": 2, "dp_shard_cp": 2, "dp_cp": 2}),
    (
        4,
        dict(dp_replicate=2),
        ("dp_replicate", "dp_shard"),
        {"dp": 4, "dp_shard_cp": 2, "dp_cp": 4},
    ),
    (2, dict(dp_replicate=2, dp_shard=1), ("dp_replicate",), {"dp": 2, "dp_cp": 2}),
    (4, dict(tp=2), ("dp_shard", "tp"), {"tp": 2, "dp": 2, "dp_shard_cp": 2}),
    (4, dict(cp=2), ("dp_shard", "cp"), {"cp": 2, "dp": 2, "dp_shard_cp": 4, "dp_cp": 4}),
    (8, dict(pp=2, tp=2), ("pp", "dp_shard", "tp"), {"pp": 2, "tp": 2, "dp": 2}),
    (8, dict(dp_replicate=2, tp=2), ("dp_replicate", "dp_shard", "tp"), {"dp": 4, "dp_cp": 4}),
    (
        4,
        dict(ep=2),
        ("dp_shard_mod_ep", "dp_shard_in_ep"),
        {"ep": 2, "efsdp": 2, "dp": 4, "dp_shard_cp": 4, "dp_cp": 4},
    ),
    (4, dict(ep=4), ("dp_shard_mod_ep", "dp_shard_in_ep"), {"ep": 4, "efsdp": 1, "dp": 4}),
    (
        8,
        dict(dp_shard=2, cp=2, tp=2, ep=2),
        ("dp_shard_mod_ep", "cp", "tp"),
        {"ep": 2, "efsdp": 2, "dp_shard_cp": 4, "dp_cp": 4, "dp": 2},
    ),
    (
        8,
        dict(dp_shard=4, tp=2, ep=2, etp=2),
        ("dp_shard_mod_ep", "dp_shard_in_ep", "tp"),
        {"ep": 2, "etp": 2, "efsdp": 2, "tp": 2},
    ),
]


@pytest.mark.parametrize("world, kwargs, root_dims, views", LAYOUTS)
def test_mesh_shapes_and_views(fake_world, world, kwargs, root_dims, views):
    fake_world(world)
    pd = dims(world, **kwargs)
    mesh = pd.world_mesh
    assert mesh_built(pd)
    assert mesh.root.mesh_dim_names == root_dims
    for name, size in views.items():
        assert mesh[name].size() == size, name
        assert mesh[name].ndim == 1
    assert mesh is pd.world_mesh  # cached


def test_absent_view_names_the_degree(fake_world):
    fake_world(4)
    pd = dims(4)
    with pytest.raises(KeyError, match="tensor_parallel_degree > 1"):
        pd.world_mesh["tp"]
    with pytest.raises(KeyError, match="expert_parallel_degree > 1"):
        pd.world_mesh["ep"]


def test_fsdp_mesh_is_1d_for_fsdp_and_2d_only_for_hsdp(fake_world):
    fake_world(8)
    fsdp = dims(8, tp=2).fsdp_mesh
    assert fsdp.ndim == 1 and fsdp.size() == 4
    hsdp = dims(8, dp_replicate=2, cp=2).fsdp_mesh
    assert hsdp.ndim == 2 and tuple(hsdp.shape) == (2, 4)  # (replicate, dp_shard*cp)
    assert dims(8, dp_replicate=8, dp_shard=1).fsdp_mesh is None  # DDP: nothing sharded


MESH_PROBE = """
import json, os, torch.distributed as dist
from torchtitan.distributed import ParallelDims
dist.init_process_group("gloo")
pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=2, etp=2,
                  world_size=dist.get_world_size(), device_type="cpu")
m = pd.world_mesh
out = {n: [m[n].size(), m[n].get_local_rank()] for n in m.view_names}
with open(os.path.join(os.environ["PROBE_DIR"], f"{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
from torchtitan.distributed.process import exit_skipping_static_destructors, leave_together
leave_together()
exit_skipping_static_destructors(0)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_real_gloo_mesh_with_ep_and_tp(tmp_path):
    probes = run_probe(8, MESH_PROBE, tmp_path)
    assert len(probes) == 8
    assert {v["tp"][0] for v in probes.values()} == {2}
    assert {v["ep"][0] for v in probes.values()} == {2}
    # tp is the innermost dim: ranks 0 and 1 share tp group, differ in tp rank
    assert probes[0]["tp"][1] == 0 and probes[1]["tp"][1] == 1
    assert probes[0]["ep"][1] == 0 and probes[2]["ep"][1] == 1
