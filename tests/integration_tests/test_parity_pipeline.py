"""Pipeline parallel schedules, alone and composed with FSDP and TP, give the 1-process
losses and grad norms; every offered schedule runs (GPipe, 1F1B, Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, a CSV schedule), also with context parallel
inside the stages (CP 2 x PP 2 under every schedule and CP method, TP 2 x CP 2 x PP 2)."""

from pathlib import Path

import pytest

from tests.parity import assert_parity, ci_subset, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def pp(schedule):
    return [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        schedule,
    ]


CP2 = ["--parallelism.context_parallel_degree", "2"]

CASES = {
    "pp2_gpipe": (2, 1, pp("GPipe")),
    "pp2_1f1b": (2, 1, pp("1F1B")),
    "pp2_interleaved_1f1b": (2, 1, pp("Interleaved1F1B")),
    "pp2_looped_bfs": (2, 1, pp("LoopedBFS")),
    "pp2_interleaved_zero_bubble": (2, 1, pp("InterleavedZeroBubble")),
    "pp2_zbv_zero_bubble": (2, 1, pp("ZBVZeroBubble")),
    "pp2_fsdp2": (4, 2, pp("1F1B")),
    "pp2_tp2": (4, 1, pp("1F1B") + ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2_fsdp2_tp2": (8, 2, pp("Interleaved1F1B") + ["--parallelism.tensor_parallel_degree", "2"]),
    # context parallel inside the stages: every schedule, each CP method, and TP x CP x PP
    "pp2_cp2_1f1b": (4, 1, pp("1F1B") + CP2),
    "pp2_cp2_gpipe_ring": (
        4,
        1,
        pp("GPipe") + CP2 + ["--parallelism.context_parallel_rotate_method", "alltoall"],
    ),
    "pp2_cp2_looped_bfs_ulysses": (
        4,
        1,
        pp("LoopedBFS") + CP2 + ["--parallelism.context_parallel_rotate_method", "ulysses"],
    ),
    "pp2_cp2_interleaved_zero_bubble": (4, 1, pp("InterleavedZeroBubble") + CP2),
    "pp2_cp2_zbv_zero_bubble": (4, 1, pp("ZBVZeroBubble") + CP2),
    "pp2_cp2_tp2_interleaved_1f1b": (
        8,
        1,
        pp("Interleaved1F1B") + CP2 + ["--parallelism.tensor_parallel_degree", "2"],
    ),
}


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
COVERED_BY = {
    "pp2_fsdp2": "pp2_fsdp2_tp2",
    "pp2_tp2": "pp2_fsdp2_tp2",
    "pp2_gpipe": "pp2_cp2_gpipe_ring",
    "pp2_1f1b": "pp2_cp2_1f1b",
    "pp2_interleaved_1f1b": "pp2_fsdp2_tp2",
    "pp2_looped_bfs": "pp2_cp2_looped_bfs_ulysses",
    "pp2_interleaved_zero_bubble": "pp2_cp2_interleaved_zero_bubble",
    "pp2_zbv_zero_bubble": "pp2_cp2_zbv_zero_bubble",
}


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_parity_with_one_process(case, reference_run, tmp_path):
    nproc, dp, overrides = CASES[case]
    assert_parity(reference_run, train(nproc, tmp_path, overrides, dp=dp))


def _write_looped_csv(
    path: Path, pp_degree: int = 2, stages_per_rank: int = 2, microbatches: int = 8
) -> Path:
    """A compute-only CSV schedule (one row per pp rank): each rank runs all forwards of its
    stages in order, then all backwards in reverse stage order (stage s lives on rank
    s % pp_degree, as the stage plan places them)."""
    rows = []
    for rank in range(pp_degree):
        stages = [rank + k * pp_degree for k in range(stages_per_rank)]
        forwards = [f"{s}F{m}" for s in stages for m in range(microbatches)]
        backwards = [f"{s}B{m}" for s in reversed(stages) for m in range(microbatches)]
        rows.append(",".join(forwards + backwards))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_csv_schedule_parity_with_one_process(reference_run, tmp_path):
    csv = _write_looped_csv(tmp_path / "schedule.csv")
    overrides = pp("Interleaved1F1B") + ["--parallelism.pipeline_parallel_schedule_csv", str(csv)]
    assert_parity(reference_run, train(2, tmp_path / "run", overrides, dp=1))
