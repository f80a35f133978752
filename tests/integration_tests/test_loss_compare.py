"""scripts/loss_compare.py passes two identical deterministic runs and catches a planted
learning-rate change."""

import shlex
import subprocess
import sys

import pytest

from tests.launcher import REPO_ROOT, run_torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCRIPT = REPO_ROOT / "scripts" / "loss_compare.py"
TINY_OPTIONS = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--training.mixed_precision_param",
    "float32",
    "--training.data_shards",
    "8",
    "--lr_scheduler.warmup_steps",
    "2",
]
STEPS = 5


def _loss_compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=240,
    )


@pytest.fixture(scope="module")
def identical_runs(tmp_path_factory):
    """Both runs trained by the script itself from the same config and options."""
    output = tmp_path_factory.mktemp("loss_compare")
    result = _loss_compare(
        "--config",
        "train_configs/debug_model.toml",
        "--options",
        shlex.join(TINY_OPTIONS),
        "--steps",
        str(STEPS),
        "--output-dir",
        str(output),
        "--assert-equal",
        "--rtol",
        "0",  # same config, seed and deterministic algorithms: bitwise equal
    )
    return output, result


def test_identical_runs_pass(identical_runs) -> None:
    _, result = identical_runs
    assert result.returncode == 0, result.stdout + result.stderr
    assert "runs equal (rtol 0)" in result.stdout
    table = result.stdout.split("|diff|", 1)[1]
    assert all(f"\n{step:>6}  " in table for step in range(1, STEPS + 1))
    assert "largest loss difference: 0.000e+00" in result.stdout


def test_a_planted_lr_change_is_detected(identical_runs, tmp_path) -> None:
    output, _ = identical_runs
    run_torchrun(
        1,
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            *TINY_OPTIONS,
            "--training.steps",
            str(STEPS),
            "--metrics.log_freq",
            "1",
            "--debug.seed",
            "42",
            "--debug.deterministic",
            "--optimizer.lr",
            "1.6e-3",
            "--job.dump_folder",
            str(tmp_path),
        ],
    )
    result = _loss_compare(
        "--baseline-dump",
        str(output / "baseline"),
        "--test-dump",
        str(tmp_path),
        "--assert-equal",
        "--rtol",
        "1e-4",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "MISMATCH step 2: loss" in result.stdout  # step 1 trains before the lr matters
    assert "runs differ" in result.stdout
