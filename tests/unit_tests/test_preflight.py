"""Layout checks that need the world size and model run before any process group."""

import pytest

from tests.layouts import mesh_built
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.preflight import check_inputs, preflight


def check(world_size, *args, device="cpu"):
    config = ConfigManager().parse_args(["--model.flavor", "debugmodel_tiny", *args])
    return preflight(config, world_size, device)


def test_valid_layout_returns_parallel_dims():
    pd = check(8, "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "64")
    assert pd.tp == 2 and pd.dp_shard == 4 and not mesh_built(pd)


@pytest.mark.parametrize(
    "world, args, message",
    [
        (
            3,
            ["--parallelism.tensor_parallel_degree", "3"],
            "tensor_parallel_degree (3) must divide the model's n_heads (8)",
        ),
        (
            8,
            ["--parallelism.tensor_parallel_degree", "8"],
            "must divide the model's n_kv_heads (4)",
        ),
        (
            2,
            ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "66"],
            "training.seq_len (66) must be divisible by tp * 2 * cp = 4",
        ),
        (4, ["--parallelism.data_parallel_shard_degree", "3"], "must equal world_size 4"),
        (
            4,
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
            "does not compose with tensor_parallel_degree",
        ),
        (2, ["--model.flavor", "huge"], "model.flavor: unknown flavor 'huge'"),
        (2, ["--training.enable_cpu_offload"], "already trains on the CPU"),
        (
            2,
            [
                "--parallelism.context_parallel_degree",
                "2",
                "--training.seq_len",
                "64",
                "--validation.enable",
                "--validation.seq_len",
                "66",
            ],
            "validation.seq_len 66 must be divisible by 4 (= 2 * cp 2 * tp 1)",
        ),
        (
            2,
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--training.seq_len",
                "64",
                "--validation.enable",
                "--validation.seq_len",
                "65",
            ],
            "validation.seq_len (65) must be divisible by tp * 2 * cp = 4",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.local_batch_size",
                "4",
                "--training.seq_len",
                "64",
                "--validation.enable",
                "--validation.seq_len",
                "64",
            ],
            "set validation.seq_len = training.seq_len (64) and validation.local_batch_size = "
            "training.local_batch_size (4); got 64 and 8",
        ),
    ],
)
def test_bad_layouts_give_one_line(world, args, message):
    with pytest.raises(ConfigError) as e:
        check(world, *args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_async_tp_needs_cuda_and_compile():
    with pytest.raises(ConfigError, match="needs compile.enable"):
        check(
            2,
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.enable_async_tensor_parallel",
        )
    with pytest.raises(ConfigError, match="needs CUDA"):
        check(
            2,
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.enable_async_tensor_parallel",
            "--compile.enable",
            device="cpu",
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.dataloader.pin_memory"], "training.dataloader.pin_memory: needs CUDA"),
        (["--profiling.enable_memory_snapshot"], "profiling.enable_memory_snapshot: needs CUDA"),
        (["--compile.enable", "--compile.backend", "cudagraphs"], "compile.backend: needs CUDA"),
        (
            ["--compile.enable", "--compile.backend", "nosuch"],
            "compile.backend: unknown backend 'nosuch'; valid: ",
        ),
    ],
)
def test_features_the_device_cannot_run_are_refused_before_launch(args, message):
    config = ConfigManager().parse_args(args)
    with pytest.raises(ConfigError) as e:
        check_inputs(config, "cpu")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    if "needs CUDA" in message:
        check_inputs(config, "cuda")


PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.seq_len", "64"]


@pytest.mark.parametrize(
    "world, args, message",
    [
        (
            2,
            PP2 + ["--parallelism.pipeline_parallel_split_points", "layers.9"],
            "pipeline_parallel_split_points: 'layers.9' names no layer",
        ),
        (2, PP2 + ["--parallelism.pipeline_parallel_split_points", "blocks.2"], "names no layer"),
        (
            8,
            ["--parallelism.pipeline_parallel_degree", "8", "--training.seq_len", "64"],
            "8 stages but only 4 layers",
        ),
        (
            2,
            PP2
            + [
                "--training.local_batch_size",
                "6",
                "--parallelism.pipeline_parallel_microbatch_size",
                "4",
            ],
            "training.local_batch_size (6) must be divisible by "
            "parallelism.pipeline_parallel_microbatch_size (4)",
        ),
        (
            2,
            PP2 + ["--parallelism.pipeline_parallel_schedule", "2F2B"],
            "unknown schedule '2F2B'; valid: GPipe",
        ),
        (
            2,
            PP2
            + [
                "--parallelism.pipeline_parallel_schedule",
                "GPipe",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "1",
            ],
            "GPipe runs one stage per rank",
        ),
    ],
)
def test_bad_pipeline_input_gives_one_line(world, args, message):
    with pytest.raises(ConfigError) as e:
        check(world, *args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_stage_plans():
    from torchtitan.distributed.pipeline import plan_stages

    def plan(*args):
        config = ConfigManager().parse_args(["--model.flavor", "debugmodel_tiny", *args])
        return plan_stages(config.parallelism, 4, 2)

    assert plan().layers == [[0, 1], [2, 3]]  # embedding and output count as a layer each
    assert plan("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B").layers == [
        [0],
        [1, 2],
        [3],
        [],
    ]
    assert plan("--parallelism.pipeline_parallel_split_points", "layers.1").layers == [
        [0],
        [1, 2, 3],
    ]
    zbv = plan("--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble")
    assert zbv.stages_of_rank(0, 2) == [0, 3] and zbv.stages_of_rank(1, 2) == [1, 2]


@pytest.mark.parametrize(
    "world, args, message",
    [
        (
            2,
            ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"],
            "must be divisible by tp * 2 * cp = 4",
        ),
        (
            4,
            [
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.seq_len",
                "64",
            ],
            None,  # context parallel inside pipeline stages
        ),
        (
            4,
            [
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.seq_len",
                "66",
            ],
            "must be divisible by tp * 2 * cp = 4",
        ),
        (
            4,
            [
                "--parallelism.context_parallel_degree",
                "4",
                "--parallelism.context_parallel_rotate_method",
                "ulysses",
                "--parallelism.tensor_parallel_degree",
                "1",
                "--training.seq_len",
                "64",
                "--model.flavor",
                "debugmodel",
            ],
            None,
        ),
    ],
)
def test_context_parallel_layouts(world, args, message):
    if message is None:
        check(world, *args)
        return
    with pytest.raises(ConfigError) as e:
        check(world, *args)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "model, flavor", [("deepseek_v3", "debugmodel"), ("qwen3", "debugmodel_moe")]
)
def test_moe_models_compile_but_refuse_async_tp_before_launch(model, flavor):
    moe = ("--model.name", model, "--model.flavor", flavor)
    check(1, *moe, "--compile.enable")
    async_tp = ("--parallelism.tensor_parallel_degree", "2", "--compile.enable")
    with pytest.raises(
        ConfigError,
        match=rf"^parallelism.enable_async_tensor_parallel: not supported for {model} {flavor}",
    ):
        check(2, *moe, *async_tp, "--parallelism.enable_async_tensor_parallel", device="cuda")
