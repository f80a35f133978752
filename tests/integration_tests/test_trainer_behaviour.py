"""Trainer behaviour beyond parity: failures stop every rank, outputs land on disk."""

import time

import pytest

from tests.launcher import run_torchrun
from tests.parity import BASE_OVERRIDES

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def args(tmp_path, *extra):
    return [
        *BASE_OVERRIDES,
        "--training.local_batch_size",
        "4",
        "--job.dump_folder",
        str(tmp_path),
        *extra,
    ]


def test_nonfinite_loss_stops_every_rank_naming_the_step(tmp_path):
    result = run_torchrun(
        2,
        args(tmp_path, "--optimizer.lr", "1e6", "--training.max_norm", "1e9"),
        check=False,
        timeout=200,
    )
    assert result.returncode != 0
    assert "the loss or grad norm is not finite" in result.stdout
    assert "step " in result.stdout.split("not finite")[0].splitlines()[-1]


def test_nonfinite_steps_can_be_skipped(tmp_path):
    result = run_torchrun(
        1,
        args(
            tmp_path,
            "--optimizer.lr",
            "1e6",
            "--training.max_norm",
            "1e9",
            "--training.skip_nonfinite_steps",
            "--training.steps",
            "6",
        ),
        check=False,
        timeout=200,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "non-finite loss or grad norm; step skipped" in result.stdout


def test_exception_on_one_rank_tears_down_all_without_hanging(tmp_path):
    start = time.monotonic()
    result = run_torchrun(
        2,
        args(
            tmp_path,
            "--experimental.custom_import",
            "tests.integration_tests.failing_rank_example",
            "--model.name",
            "llama3_failing_rank",
        ),
        check=False,
        timeout=200,
    )
    assert result.returncode != 0
    assert "planted failure on rank 1" in result.stdout
    assert time.monotonic() - start < 150


def test_tensorboard_and_profiler_traces_are_written(tmp_path):
    run_torchrun(
        1,
        args(
            tmp_path,
            "--training.steps",
            "4",
            "--metrics.enable_tensorboard",
            "--profiling.enable_profiling",
            "--profiling.profile_freq",
            "4",
        ),
        timeout=200,
    )
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert list((tmp_path / "profile_traces").rglob("rank0_trace.json"))


def test_cpu_training_keeps_freed_memory_unless_switched_off(tmp_path):
    line = "CPU allocator: freed memory stays with the process for reuse"
    kept = run_torchrun(1, args(tmp_path / "kept", "--training.steps", "1"), timeout=200)
    assert line in kept.stdout
    default = run_torchrun(
        1,
        args(tmp_path / "off", "--training.steps", "1", "--training.no-cpu_keep_freed_memory"),
        timeout=200,
    )
    assert line not in default.stdout
