"""Large runs' silent failures, planted in 4 processes: a hang is reported within the
configured time naming the rank that is elsewhere and its line, with a stack file per rank."""

from __future__ import annotations

import re
import time

import pytest

from tests.launcher import run_torchrun
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
            "3",
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
    stacks = sorted((hangs / "step-7").iterdir())
    assert [p.name for p in stacks] == [f"rank-{r}.txt" for r in range(4)]
    assert "time.sleep(debug.hang_seconds)" in stacks[1].read_text()
    assert "dist.all_reduce(flags" in stacks[0].read_text()
