"""Fixtures the unit tests share."""

import pytest
import torch.distributed as dist


@pytest.fixture
def fake_rank1_of_2():
    """A fake 2-rank process group in which this process is rank 1."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=2)
    try:
        yield dist.device_mesh.init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def single_rank_gloo(tmp_path_factory):
    """A 1-rank gloo process group for the tests of a module (kept if one exists)."""
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
