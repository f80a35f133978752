"""Context parallel (each rotate method), alone and with FSDP, HSDP and TP, gives the
1-process losses and grad norms."""

import pytest

from tests.parity import assert_parity, ci_subset, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def cp(degree, method="allgather", balancer="headtail"):
    return [
        "--parallelism.context_parallel_degree",
        str(degree),
        "--parallelism.context_parallel_rotate_method",
        method,
        "--parallelism.context_parallel_load_balancer",
        balancer,
    ]


TP2 = ["--parallelism.tensor_parallel_degree", "2"]

CASES = {
    "cp2_allgather": (2, 1, cp(2)),
    "cp2_alltoall_no_balancer": (2, 1, cp(2, "alltoall", "none")),
    "cp4_alltoall": (4, 1, cp(4, "alltoall")),
    "cp2_ulysses": (2, 1, cp(2, "ulysses")),
    "fsdp2_cp2": (4, 2, cp(2)),
    "hsdp2x1_cp2": (
        4,
        2,
        cp(2)
        + [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
    ),
    "tp2_cp2": (4, 1, cp(2, "alltoall") + TP2),
    "fsdp2_tp2_cp2": (8, 2, cp(2) + TP2),
}


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
COVERED_BY = {
    "fsdp2_cp2": "fsdp2_tp2_cp2",
}


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_parity_with_one_process(case, reference_run, tmp_path):
    nproc, dp, overrides = CASES[case]
    assert_parity(reference_run, train(nproc, tmp_path, overrides, dp=dp))
