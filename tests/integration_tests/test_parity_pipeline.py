"""Pipeline parallel schedules, alone and composed with FSDP and TP, give the 1-process
losses and grad norms."""

import pytest

from tests.parity import assert_parity, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def pp(schedule):
    return ["--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", schedule]


CASES = {
    "pp2_gpipe": (2, 1, pp("GPipe")),
    "pp2_1f1b": (2, 1, pp("1F1B")),
    "pp2_interleaved_1f1b": (2, 1, pp("Interleaved1F1B")),
    "pp2_zbv_zero_bubble": (2, 1, pp("ZBVZeroBubble")),
    "pp2_fsdp2": (4, 2, pp("1F1B")),
    "pp2_tp2": (4, 1, pp("1F1B") + ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2_fsdp2_tp2": (8, 2, pp("Interleaved1F1B") + ["--parallelism.tensor_parallel_degree", "2"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_one_process(case, reference_run, tmp_path):
    nproc, dp, overrides = CASES[case]
    assert_parity(reference_run, train(nproc, tmp_path, overrides, dp=dp))
