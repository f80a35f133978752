"""DeepSeek-V3 flavors and the layout checks that run before any process group."""

import pytest
import torch

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.preflight import preflight
from torchtitan.protocols import get_train_spec


@pytest.mark.parametrize("flavor, billions", [("16B", 15.7), ("671B", 671.0)])
def test_published_flavors_have_the_published_size(flavor, billions):
    spec = get_train_spec("deepseek_v3")
    args = spec.flavor_args(flavor)
    with torch.device("meta"):
        model = spec.model_cls(args)
    nparams, _ = args.get_nparams_and_flops(model, 4096)
    assert nparams / 1e9 == pytest.approx(billions, abs=0.05)


def check(world_size: int, *args: str):
    config = ConfigManager().parse_args(
        [
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "debugmodel",
            "--training.seq_len",
            "64",
            *args,
        ]
    )
    return preflight(config, world_size, "cpu")


def test_expert_parallel_layout_is_accepted():
    dims = check(
        4,
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.expert_tensor_parallel_degree",
        "2",
    )
    assert (dims.dp_shard, dims.ep, dims.etp) == (2, 2, 2)


@pytest.mark.parametrize(
    "world, args, message",
    [
        (
            6,
            ["--parallelism.expert_parallel_degree", "3"],
            "expert_parallel_degree (3) must divide the model's number of routed experts (8)",
        ),
        (2, ["--parallelism.expert_parallel_degree", "4"], "dp_shard*cp must be divisible by ep"),
        (
            4,
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
                "--parallelism.data_parallel_replicate_degree",
                "2",
            ],
            "dp_shard*cp must be divisible by ep",
        ),
        (
            4,
            ["--parallelism.expert_tensor_parallel_degree", "2"],
            "expert_tensor_parallel_degree: must be 1 or tensor_parallel_degree (1)",
        ),
        (8, ["--parallelism.tensor_parallel_degree", "8"], "must divide the model's n_heads (4)"),
    ],
)
def test_impossible_expert_layouts_give_one_line(world, args, message):
    with pytest.raises(ConfigError) as e:
        check(world, *args)
    assert message in str(e.value) and "\n" not in str(e.value)
