"""Fault-tolerance settings: one line per bad setting, the lighthouse check before launch, and
the data split and global batch over replica groups."""

from __future__ import annotations

import socket

import pytest

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.distributed.fault_tolerance import LIGHTHOUSE_ENV, check_fault_tolerance_inputs
from torchtitan.distributed.parallel_dims import parallel_dims_from_config
from torchtitan.recipe import grad_accumulation_steps

FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]


def parse(*args: str):
    return ConfigManager().parse_args(["--model.flavor", "debugmodel_tiny", *args])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fault_tolerance.enable"], "fault_tolerance.group_size: must be >= 1"),
        (
            [*FT, "--fault_tolerance.replica_id", "2"],
            "fault_tolerance.replica_id: must be in 0 .. group_size - 1 = 1, got 2",
        ),
        (
            [*FT, "--fault_tolerance.min_replica_size", "3"],
            "fault_tolerance.min_replica_size: must be in 1 .. group_size = 2",
        ),
        (
            [*FT, "--fault_tolerance.semi_sync_method", "hogwild"],
            "fault_tolerance.semi_sync_method: must be unset",
        ),
        (
            [
                *FT,
                "--fault_tolerance.semi_sync_method",
                "diloco",
                "--parallelism.pipeline_parallel_degree",
                "2",
            ],
            "fault_tolerance.semi_sync_method='diloco': not with pipeline parallel",
        ),
        (
            [
                *FT,
                "--fault_tolerance.semi_sync_method",
                "diloco",
                "--fault_tolerance.fragment_sync_delay",
                "5",
            ],
            "fault_tolerance.fragment_sync_delay: must be in 0 .. sync_steps - 1",
        ),
        *(
            (
                [*FT, "--fault_tolerance.semi_sync_method", "local_sgd", *setting],
                f"fault_tolerance.{setting[0].split('.')[-1]}: only DiLoCo reads it",
            )
            for setting in (
                ["--fault_tolerance.should_quantize"],
                ["--fault_tolerance.fragment_sync_delay", "1"],
                ["--fault_tolerance.fragment_update_alpha", "0.5"],
            )
        ),
    ],
)
def test_bad_setting_is_one_line_naming_it(args, message):
    with pytest.raises(ConfigError) as error:
        parse(*args)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_diloco_settings_pass_with_diloco():
    parse(
        *FT,
        "--fault_tolerance.semi_sync_method",
        "diloco",
        "--fault_tolerance.fragment_sync_delay",
        "1",
        "--fault_tolerance.fragment_update_alpha",
        "0.5",
    )


def test_fault_tolerance_needs_the_lighthouse_address(monkeypatch):
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"fault_tolerance.enable: set {LIGHTHOUSE_ENV}"):
        check_fault_tolerance_inputs(parse(*FT).fault_tolerance)


def test_unreachable_lighthouse_is_one_line_naming_the_address(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(LIGHTHOUSE_ENV, f"http://localhost:{port}")
    with pytest.raises(ConfigError) as error:
        check_fault_tolerance_inputs(
            parse(*FT, "--fault_tolerance.process_group_timeout_ms", "2000").fault_tolerance
        )
    assert f"no torchft lighthouse reachable at {LIGHTHOUSE_ENV}=http://localhost:{port}" in str(
        error.value
    )


def test_reachable_lighthouse_passes(monkeypatch):
    with socket.socket() as server:
        server.bind(("localhost", 0))
        server.listen()
        monkeypatch.setenv(LIGHTHOUSE_ENV, f"http://localhost:{server.getsockname()[1]}")
        check_fault_tolerance_inputs(parse(*FT).fault_tolerance)


def test_replica_groups_split_the_data_and_the_global_batch():
    config = parse(
        *FT,
        "--fault_tolerance.replica_id",
        "1",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "8",
    )
    dims = parallel_dims_from_config(config.parallelism, config.fault_tolerance, world_size=1)
    assert dims.data_layout() == (1, 2)  # group 1's only rank is data rank 1 of 2
    assert grad_accumulation_steps(config.training, dims) == 2  # 8 = 2 x (1 rank x 2 groups) x 2
    plain = parse("--training.local_batch_size", "2", "--training.global_batch_size", "8")
    assert parallel_dims_from_config(
        plain.parallelism, plain.fault_tolerance, world_size=1
    ).data_layout() == (0, 1)
