"""Automatic restart as the console shows it (./run_train.sh with MAX_RESTARTS, tiny Llama 3,
fp32, CPU/gloo): one line per restart and one error line at the end, the tracebacks in the
dump folder, never torchrun's logs or report; the restarted run still resumes exactly."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launcher import read_metrics, run_command
from tests.parity import train, train_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

RUN = [
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "4",
    "--training.steps",
    "5",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "1",
]
FAULT_AT_3 = ["--debug.fail_at_step", "3"]
TORCHRUN_LOG = re.compile(r"^[EWI]\d{4} ", re.MULTILINE)  # torchrun's own log lines


def run_train_sh(nproc: int, folder: Path, overrides: list[str], max_restarts: int):
    env = {"NGPU": str(nproc), "MAX_RESTARTS": str(max_restarts)}
    return run_command(
        ["./run_train.sh", *train_args(nproc, folder, overrides)], env=env, timeout=240
    )


def restart_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("restart ")]


def assert_quiet(output: str) -> None:
    """No traceback, no torchrun report and no torchrun log line on the console."""
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-6000:]
    assert not TORCHRUN_LOG.search(output), output[-6000:]


def test_a_restart_is_one_line_and_resumes_exactly(tmp_path):
    """FSDP 2, a checkpoint every step, rank 0 raises at step 3 in the first attempt: one
    restart line names the rank, the step, the error, the checkpoint resumed from and the
    tracebacks file; every step's loss and grad norm are bitwise those of an uninterrupted
    run (trained at the same time)."""
    with ThreadPoolExecutor(1) as pool:
        straight = pool.submit(train, 2, tmp_path / "straight", RUN)
        result = run_train_sh(2, tmp_path / "restarted", RUN + FAULT_AT_3, max_restarts=1)
        reference = straight.result()
    out = result.stdout
    assert result.returncode == 0, out[-6000:]
    tracebacks = tmp_path / "restarted" / "tracebacks.log"
    assert restart_lines(out) == [
        "restart 1 of 1: rank 0 failed at step 3 (InjectedFault: debug.fail_at_step: injected "
        "fault at step 3 on rank 0); resuming from the newest complete checkpoint (step 2); "
        f"tracebacks in {tracebacks}"
    ], out[-6000:]
    assert_quiet(out)
    logged = tracebacks.read_text()
    assert "rank 0 (local rank 0), attempt 1, step 3" in logged
    assert "InjectedFault: debug.fail_at_step: injected fault at step 3 on rank 0" in logged
    restarted = read_metrics(tmp_path / "restarted")
    assert [r["step"] for r in restarted] == [1, 2, 3, 4, 5]
    pairs = [(r["loss"], r["grad_norm"]) for r in restarted]
    assert pairs == [(r["loss"], r["grad_norm"]) for r in reference]


def test_restarts_used_up_end_with_one_error_line(tmp_path):
    """The fault in every attempt, MAX_RESTARTS=1: a restart line, then one error line
    (exit 1) instead of torchrun's report."""
    fault = ["--training.steps", "2", "--debug.fail_at_step", "2", "--debug.fail_every_attempt"]
    result = run_train_sh(1, tmp_path, fault, max_restarts=1)
    out = result.stdout
    assert result.returncode == 1, out[-6000:]
    error = (
        "rank 0 failed at step 2 (InjectedFault: debug.fail_at_step: injected fault at step 2 "
        "on rank 0)"
    )
    tracebacks = tmp_path / "tracebacks.log"
    assert restart_lines(out) == [
        f"restart 1 of 1: {error}; starting again from step 1 (checkpoint.enable is off); "
        f"tracebacks in {tracebacks}"
    ], out[-6000:]
    assert out.rstrip().splitlines()[-1] == (
        f"error: {error}; not restarted: MAX_RESTARTS=1 used up; tracebacks in {tracebacks}"
    ), out[-6000:]
    assert_quiet(out)
    assert tracebacks.read_text().count("InjectedFault: debug.fail_at_step") == 2


def test_a_crash_loop_names_the_error_and_the_tracebacks(tmp_path):
    """The fault at step 2 in every attempt: after the second failure there the run stops
    with one error line (exit 2) although MAX_RESTARTS would allow 3 more attempts."""
    fault = [
        "--training.steps",
        "2",
        "--debug.fail_at_step",
        "2",
        "--debug.fail_every_attempt",
        "--checkpoint.max_failures_at_same_step",
        "2",
    ]
    result = run_train_sh(1, tmp_path, fault, max_restarts=4)
    out = result.stdout
    assert result.returncode == 2, out[-6000:]
    assert len(restart_lines(out)) == 1, out[-6000:]
    assert out.rstrip().splitlines()[-1] == (
        "error: checkpoint.max_failures_at_same_step: the run failed 2 times at step 2 "
        "(InjectedFault: debug.fail_at_step: injected fault at step 2 on rank 0); not "
        f"restarting again (tracebacks in {tmp_path / 'tracebacks.log'})"
    ), out[-6000:]
    assert_quiet(out)
