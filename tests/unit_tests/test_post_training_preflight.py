"""DPO and GRPO layouts before launch: what runs passes preflight, what does not yet is one
line naming the field."""

from __future__ import annotations

import pytest

from tests.launcher import REPO_ROOT
from tests.parity import dpo_args, grpo_args
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.preflight import preflight

DPO = dpo_args(str(REPO_ROOT / "tests" / "assets" / "preference_tiny.jsonl"))
GRPO = [
    *grpo_args(num_generations=4),
    "--training.global_batch_size",
    "16",
    "--training.local_batch_size",
    "4",
]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]


def check(args: list[str], world_size: int) -> None:
    preflight(
        ConfigManager().parse_args(["--model.flavor", "debugmodel", *args]), world_size, "cpu"
    )


@pytest.mark.parametrize(
    ("args", "world_size"),
    [
        (DPO + TP2, 2),
        (DPO, 2),
        (DPO + PP2, 2),
        (DPO + PP2 + TP2, 4),
        (DPO + CP2, 2),
        (GRPO + TP2, 2),
        (GRPO + TP2, 4),
        (GRPO, 4),
    ],
    ids=[
        "dpo_tp2",
        "dpo_fsdp2",
        "dpo_pp2",
        "dpo_tp2_pp2",
        "dpo_cp2",
        "grpo_tp2",
        "grpo_fsdp2_tp2",
        "grpo_fsdp4",
    ],
)
def test_supported_layouts_pass(args: list[str], world_size: int) -> None:
    check(args, world_size)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            DPO + PP2 + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
            "dpo.enable: the reference's forward-only pass cannot run under the V-shaped "
            "parallelism.pipeline_parallel_schedule 'ZBVZeroBubble'",
        ),
        (
            DPO + CP2 + PP2,
            "dpo.enable: context parallel with pipeline parallel is not supported with DPO yet",
        ),
        (GRPO + PP2, "grpo.enable: pipeline parallel is not supported with GRPO yet"),
        (GRPO + CP2, "grpo.enable: context parallel is not supported with GRPO yet"),
    ],
    ids=["dpo_pp2_zbv", "dpo_cp2_pp2", "grpo_pp2", "grpo_cp2"],
)
def test_layouts_not_run_yet_are_one_line(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        check(args, 4)
    assert "\n" not in str(error.value)
