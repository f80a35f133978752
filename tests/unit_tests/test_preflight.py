"""Layout checks that need the world size and model run before any process group."""

import pytest

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.config.preflight import preflight


def check(world_size, *args, device="cpu"):
    config = ConfigManager().parse_args(["--model.flavor", "debugmodel_tiny", *args])
    return preflight(config, world_size, device)


def test_valid_layout_returns_parallel_dims():
    pd = check(8, "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "64")
    assert pd.tp == 2 and pd.dp_shard == 4 and not pd.mesh_built


@pytest.mark.parametrize("world, args, message", [
    (3, ["--parallelism.tensor_parallel_degree", "3"],
     "tensor_parallel_degree (3) must divide the model's n_heads (8)"),
    (8, ["--parallelism.tensor_parallel_degree", "8"],
     "must divide the model's n_kv_heads (4)"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "66"],
     "training.seq_len (66) must be divisible by tp * 2 * cp = 4"),
    (4, ["--parallelism.data_parallel_shard_degree", "3"], "must equal world_size 4"),
    (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2",
         "--parallelism.data_parallel_shard_degree", "1"], "does not compose with tensor_parallel_degree"),
    (2, ["--model.flavor", "huge"], "model.flavor: unknown flavor 'huge'"),
])
def test_bad_layouts_give_one_line(world, args, message):
    with pytest.raises(ConfigError) as e:
        check(world, *args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_async_tp_needs_cuda_and_compile():
    with pytest.raises(ConfigError, match="needs compile.enable"):
        check(2, "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel")
    with pytest.raises(ConfigError, match="needs CUDA"):
        check(2, "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel",
              "--compile.enable", device="cpu")
