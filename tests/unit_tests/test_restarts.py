"""The failure records of automatic restart and the launcher's one line about them, without
launching anything (the runs are in tests/integration_tests/test_restart_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from torchtitan.components.checkpointing.safe_loading import MANIFEST_FILE
from torchtitan.distributed.launch import RestartReport, newest_full_checkpoint
from torchtitan.distributed.restarts import (
    WORKER_START_ENV,
    Failure,
    describe_error,
    read_failures,
    record_failure,
)

INJECTED = Failure(local_rank=1, step=3, attempt=0, rank=1, error="InjectedFault: at step 3")
PEER = Failure(local_rank=0, step=3, attempt=0, rank=0, error="RuntimeError: Connection closed")


def test_describe_error_is_one_line_without_tabs():
    assert describe_error(ValueError("first\tline\nsecond line")) == "ValueError: first line"
    assert describe_error(KeyError()) == "KeyError"


def test_failures_round_trip_and_count_per_rank_and_step(tmp_path):
    failure_file = tmp_path / "failures"
    failure_file.touch()
    assert record_failure(str(failure_file), INJECTED) == 1
    assert record_failure(str(failure_file), PEER) == 1
    again = Failure(local_rank=1, step=3, attempt=1, rank=1, error="InjectedFault: again")
    assert record_failure(str(failure_file), again) == 2
    assert read_failures(failure_file) == [INJECTED, PEER, again]


def _report(tmp_path: Path, *failures: Failure) -> RestartReport:
    failure_file = tmp_path / "failures"
    failure_file.write_text("".join(f.to_line() for f in failures))
    return RestartReport(failure_file, tmp_path / "tracebacks.log", None, max_restarts=2)


def _exited(local_rank: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(
        local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode, error_file=""
    )


def test_the_restart_line_names_the_first_failure_of_the_attempt(tmp_path, monkeypatch):
    monkeypatch.setenv(WORKER_START_ENV, "0")
    report = _report(tmp_path, INJECTED, PEER)
    assert report.restart_line(1, {0: _exited(0, 1), 1: _exited(1, 1)}) == (
        "restart 1 of 2: rank 1 failed at step 3 (InjectedFault: at step 3); starting again "
        f"from step 1 (checkpoint.enable is off); tracebacks in {tmp_path / 'tracebacks.log'}"
    )


def test_without_a_record_the_line_says_how_the_rank_ended(tmp_path, monkeypatch):
    """A rank killed by a signal records nothing: no tracebacks to point at."""
    monkeypatch.setenv(WORKER_START_ENV, "1")
    report = _report(tmp_path, INJECTED)  # attempt 0's record says nothing of attempt 1
    assert report.final_line({1: _exited(1, -9)}) == (
        "error: rank 1 was killed by SIGKILL; not restarted: MAX_RESTARTS=2 used up"
    )


@pytest.mark.parametrize("step, where", [(0, "while setting up"), (7, "at step 7")])
def test_the_line_says_where_the_rank_failed(tmp_path, monkeypatch, step, where):
    monkeypatch.setenv(WORKER_START_ENV, "0")
    report = _report(tmp_path, Failure(0, step, 0, 0, "OSError: disk full"))
    assert report.cause({0: _exited(0, 1)}) == f"rank 0 failed {where} (OSError: disk full)"


def test_newest_full_checkpoint_skips_incomplete_and_model_only_ones(tmp_path):
    for name, manifest in [
        ("step-1", {"model_only": False}),
        ("step-2", {"model_only": False}),
        ("step-3", None),  # its save did not finish
        ("step-4", {"model_only": True}),  # an export: weights only
        ("step-5.tmp", {"model_only": False}),
    ]:
        (tmp_path / name).mkdir()
        if manifest is not None:
            (tmp_path / name / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert newest_full_checkpoint(tmp_path) == 2
    assert newest_full_checkpoint(tmp_path / "missing") is None
