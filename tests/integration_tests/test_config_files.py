"""Every config in train_configs/ marked ``job.use_for_integration_test = true`` trains two
steps through run_train.sh (the user's entry point, its pre-launch checks included) on one
process, in fp32 and at a short sequence so that CI stays fast on any CPU; the run's log
starts with its ``job.description``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT, read_metrics, run_command
from torchtitan.config import ConfigManager

CONFIG_DIR = REPO_ROOT / "train_configs"
MARKED = sorted(
    p
    for p in CONFIG_DIR.glob("*.toml")
    if ConfigManager().parse_args(["--job.config_file", str(p)]).job.use_for_integration_test
)
SHORT = [
    "--training.steps",
    "2",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
]


def test_the_debug_configs_are_marked():
    assert {p.stem for p in MARKED} >= {
        "debug_model",
        "debug_sft",
        "debug_dpo",
        "qwen3_debug",
        "qwen3_moe_debug",
        "deepseek_v3_debug",
        "gpt_oss_debug",
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", MARKED, ids=lambda p: p.stem)
def test_marked_config_trains_two_steps_through_run_train_sh(path: Path, tmp_path: Path):
    result = run_command(
        ["./run_train.sh", *SHORT, "--job.dump_folder", str(tmp_path)],
        timeout=220,
        env={"NGPU": "1", "CONFIG_FILE": str(path)},
    )
    assert result.returncode == 0, result.stdout[-3000:]
    description = ConfigManager().parse_args(["--job.config_file", str(path)]).job.description
    assert f"starting job: {description}" in result.stdout  # the run's first line names it
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
