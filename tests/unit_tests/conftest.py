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
