"""Large runs' silent failures, planted in 4 processes: a hang is reported within the
configured time naming the rank that is elsewhere and its line, with a stack file per rank; a
straggler is named in metrics.jsonl and one warning line, and the timeline shows it."""

from __future__ import annotations

import json
import re
import statistics
import sys
import time

import pytest

from tests.launcher import run_command, run_torchrun
from tests.parity import BASE_OVERRIDES

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

HANG_SECONDS = 120


def test_planted_hang_is_named_with_its_line_and_every_rank_exits(tmp_path):
    start = time.monotonic()
    result = run_torchrun(
        4,
        [
            *BASE_OVERRIDES,
            "--training.steps",
            "8",
            "--training.local_batch_size",
            "2",
            "--job.dump_folder",
            str(tmp_path),
            "--debug.hang_at_step",
            "7",
            "--debug.hang_seconds",
            str(HANG_SECONDS),
            "--comm.hang_timeout_floor_seconds",
            "6",
            "--comm.on_hang",
            "exit",
        ],
        check=False,
        timeout=200,
    )
    assert time.monotonic() - start < HANG_SECONDS, "the job waited for the planted sleep"
    assert result.returncode != 0
    # The first rank to exit (torchrun's root cause) exits with the hang status.
    root_cause = result.stdout.split("Root Cause")[-1]
    assert re.search(r"exitcode\s*: 124", root_cause), result.stdout[-3000:]
    lines = [line for line in result.stdout.splitlines() if "hang: step" in line]
    assert len(lines) == 1, result.stdout[-3000:]
    assert re.search(
        r"hang: step 7 has run [\d.]+ s \(threshold [\d.]+ s\); ranks 0,2,3 wait at "
        r"torch/distributed/distributed_c10d.py:\d+ in all_reduce \(from torchtitan/train.py:\d+ "
        r"in _step_flags\); not there: rank 1 \(\S+\) at "
        r"torchtitan/distributed/hang_watchdog.py:\d+ in maybe_plant_hang",
        lines[0],
    ), lines[0]
    hangs = tmp_path / "hangs"
    assert [p.name for p in hangs.iterdir()] == ["step-7"]  # steps 1-6: no stack file
    stacks = sorted((hangs / "step-7").iterdir())  # and torch's flight recorder
    assert [p.name for p in stacks] == [
        name for r in range(4) for name in (f"rank-{r}.flight_recorder", f"rank-{r}.txt")
    ]
    assert "time.sleep(debug.hang_seconds)" in (hangs / "step-7" / "rank-1.txt").read_text()
    assert "dist.all_reduce(flags" in (hangs / "step-7" / "rank-0.txt").read_text()


def test_planted_straggler_is_named_in_metrics_warning_and_timeline(tmp_path):
    """Rank 2 of 4 waits 30 % of a step in its data phase from step 5."""
    result = run_torchrun(
        4,
        [
            *BASE_OVERRIDES,
            "--training.steps",
            "12",
            "--training.local_batch_size",
            "2",
            "--job.dump_folder",
            str(tmp_path),
            "--metrics.event_log",
            "--debug.straggler_rank",
            "2",
            "--debug.straggler_from_step",
            "5",
        ],
        timeout=200,
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # A log step's record covers the steps completed before it: step 6 on, the slow ones.
    slowed = [r for r in records if r["step"] >= 6]
    # one record may name another rank: 2 cores run 4 ranks and pytest's other worker
    assert sum(r["slowest_rank"] != 2 for r in slowed) <= 1, slowed
    assert statistics.median(r["slowest_rank_excess_pct"] for r in slowed) > 15
    assert all(r["phase_time/data"] < 0.05 * r["step_time"] for r in slowed)  # the median rank's
    warnings = {
        line.split(" - WARNING - ")[1]
        for line in result.stdout.splitlines()
        if "straggler:" in line
    }
    assert len(warnings) == 1, warnings
    assert re.fullmatch(
        r"straggler: rank 2 \(\S+\) has been the slowest rank for 3 log steps, \d+% of a step "
        r"slower than the median rank, in data \([\d.]+ s per step, median rank [\d.]+ s\)",
        warnings.pop(),
    )
    events = tmp_path / "events"
    assert sorted(p.name for p in events.iterdir()) == [f"rank-{r}.jsonl" for r in range(4)]
    drawn = run_command(
        [
            sys.executable,
            "scripts/timeline.py",
            str(events),
            "--steps",
            "5:12",
            "--out",
            str(tmp_path / "timeline"),
        ]
    )
    assert drawn.returncode == 0, drawn.stdout
    rank_lines = [line for line in drawn.stdout.splitlines() if line.startswith("rank")]
    data_marked = [bool(re.search(r"data +[\d.]+\*", line)) for line in rank_lines]
    assert data_marked == [False, False, True, False], drawn.stdout
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "timeline.html").read_text().count("<rect") > 4 * 8 * 5
