"""The hang watchdog in one process: it fires only on a step far longer than the median,
writes every thread's stack, names the ranks that are elsewhere, and follows comm.on_hang."""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from torchtitan.distributed import hang_watchdog
from torchtitan.distributed.hang_watchdog import (
    HANG_EXIT_CODE,
    HangReport,
    HangWatchdog,
    record_hang_for_launcher,
    summarize_hang,
)
from torchtitan.distributed.launch import RestartReport
from torchtitan.distributed.restarts import FAILURE_FILE_ENV, TRACEBACK_FILE_ENV, WORKER_START_ENV

FLOOR = 0.3


def watchdog(tmp_path: Path, exits: list[int], **kwargs) -> HangWatchdog:
    options = dict(
        factor=5.0,
        floor_seconds=FLOOR,
        policy="wait",
        dump_folder=str(tmp_path),
        rank=0,
        world_size=1,
        store=None,
        exit_process=exits.append,
    )
    return HangWatchdog(**{**options, **kwargs})


def run_step(dog: HangWatchdog, step: int, seconds: float) -> None:
    dog.step_started(step)
    time.sleep(seconds)
    dog.step_finished(step)


def test_only_a_step_past_the_threshold_dumps_every_thread(tmp_path):
    exits: list[int] = []
    dog = watchdog(tmp_path, exits)
    for step in (1, 2, 3):
        run_step(dog, step, 0.01)
    assert dog.threshold() == FLOOR  # 5 x the median is below the floor
    run_step(dog, 4, 3 * FLOOR)
    run_step(dog, 5, 0.01)
    dog.close()
    assert sorted(p.name for p in (tmp_path / "hangs").iterdir()) == ["step-4"]
    text = (tmp_path / "hangs" / "step-4" / "rank-0.txt").read_text()
    assert "Thread MainThread" in text and "Thread hang-watchdog" in text
    assert "in run_step" in text and "time.sleep(seconds)" in text
    assert exits == []  # policy wait


def test_the_threshold_follows_the_median_step(tmp_path):
    dog = watchdog(tmp_path, [])
    assert dog.threshold() is None  # not armed before a step finished
    dog.durations.extend([0.2, 0.1, 9.0])
    assert dog.threshold() == 5.0 * 0.2
    dog.close()


def test_policy_exit_ends_the_process_with_its_status_after_the_report(tmp_path):
    exits: list[int] = []
    dog = watchdog(tmp_path, exits, policy="exit")
    run_step(dog, 1, 0.01)
    run_step(dog, 2, 3 * FLOOR)
    dog.close()
    assert exits == [HANG_EXIT_CODE]


def test_ranks_report_through_the_store_and_rank_0_names_them(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(hang_watchdog, "_COLLECT_SECONDS", 1.0)  # rank 2 never reports
    store = dist.HashStore()
    exits: list[int] = []
    dogs = [watchdog(tmp_path, exits, rank=rank, world_size=3, store=store) for rank in (1, 0)]
    for dog in dogs:
        dog.durations.append(0.01)
        dog.step_started(7)
    with caplog.at_level("ERROR"):
        time.sleep(3 * FLOOR)
        deadline = time.monotonic() + 20
        while "hang: step 7" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
    for dog in dogs:
        dog.close()
    line = next(r.message for r in caplog.records if r.message.startswith("hang: step 7"))
    # Both watchdogs run in this process, so both report this test's main thread.
    assert "ranks 0,1 wait at" in line and "test_hang_watchdog.py" in line
    assert "no report from rank 2 (stuck outside Python, or gone)" in line
    assert sorted(p.name for p in (tmp_path / "hangs" / "step-7").glob("*.txt")) == [
        "rank-0.txt",
        "rank-1.txt",
    ]


def test_summary_names_the_ranks_outside_the_collective_the_others_wait_in():
    waiting = "torch/distributed/distributed_c10d.py:3252 in all_reduce"
    reports = {
        rank: HangReport(rank, "h", waiting, "torchtitan/train.py:353 in _step_flags")
        for rank in (0, 2, 3)
    }
    reports[1] = HangReport(1, "h1", "data.py:9 in read", "torchtitan/train.py:88 in __call__")
    line = summarize_hang(7, 12.0, 10.0, reports, 5, Path("/d"))
    assert line == (
        "hang: step 7 has run 12.0 s (threshold 10.0 s); ranks 0,2,3 wait at "
        f"{waiting} (from torchtitan/train.py:353 in _step_flags); not there: rank 1 (h1) at "
        "data.py:9 in read (from torchtitan/train.py:88 in __call__); no report from rank 4 "
        "(stuck outside Python, or gone); stacks in /d"
    )


def test_summary_of_a_collective_every_rank_is_in():
    reports = {
        r: HangReport(r, "h", "c10d.py:1 in all_reduce", "c10d.py:1 in all_reduce") for r in (0, 1)
    }
    line = summarize_hang(3, 5.0, 4.0, reports, 2, Path("/d"))
    assert "ranks 0,1 wait at c10d.py:1 in all_reduce; every rank is there" in line


def test_under_automatic_restart_the_hang_is_the_attempts_failure_record(tmp_path, monkeypatch):
    failure_file, traceback_file = tmp_path / "failures", tmp_path / "dump" / "tracebacks.txt"
    monkeypatch.setenv(FAILURE_FILE_ENV, str(failure_file))
    monkeypatch.setenv(TRACEBACK_FILE_ENV, str(traceback_file))
    monkeypatch.setenv(WORKER_START_ENV, "0")
    summary = "hang: step 7 has run 5.0 s (threshold 4.0 s); not there: rank 1; stacks in /d"
    record_hang_for_launcher(7, 0, summary)
    report = RestartReport(failure_file, traceback_file, None, max_restarts=2)
    assert report.restart_line(1, {}) == (
        "restart 1 of 2: rank 0 failed at step 7 (Hang: step 7 has run 5.0 s (threshold 4.0 s); "
        "not there: rank 1); starting again from step 1 (checkpoint.enable is off); "
        f"tracebacks in {traceback_file}"
    )
    assert summary in traceback_file.read_text()
