"""Qwen3 trains like one process (per-step loss and grad norm within 1e-4, fp32): the dense
debug model under FSDP 2, TP 2 (per-head q/k norms on sharded heads), CP 2, PP 2, FSDP 2 x
TP 2, CP 2 x PP 2 and TP 2 x CP 2 x PP 2, and the MoE debug model under EP 2, FSDP 2 x EP 2
and TP 2 x EP 2 x ETP 2 (forced-balanced routing, so routing cannot flip on ties)."""

import pytest

from tests.parity import assert_loss_falls, assert_parity, ci_subset, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

DENSE = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
PP2 = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "1F1B",
]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
MOE = [
    "--model.name",
    "qwen3",
    "--model.flavor",
    "debugmodel_moe",
    "--debug.moe_force_load_balance",
]

# name: (reference, processes, data-parallel degree, overrides)
CASES = {
    "fsdp2": ("dense", 2, 2, DENSE),
    "tp2": ("dense", 2, 1, DENSE + TP2),
    "cp2": ("dense", 2, 1, DENSE + ["--parallelism.context_parallel_degree", "2"]),
    "pp2": (
        "dense",
        2,
        1,
        DENSE
        + [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
        ],
    ),
    "fsdp2_tp2": ("dense", 4, 2, DENSE + TP2),
    "cp2_pp2": ("dense", 4, 1, DENSE + CP2 + PP2),
    "tp2_cp2_pp2": ("dense", 8, 1, DENSE + TP2 + CP2 + PP2),
    "moe_ep2": ("moe", 2, 2, MOE + EP2),
    "moe_fsdp4_ep2": ("moe", 4, 4, MOE + EP2),  # experts also FSDP-sharded over efsdp 2
    "moe_tp2_ep2_etp2": (
        "moe",
        4,
        2,
        MOE + TP2 + EP2 + ["--parallelism.expert_tensor_parallel_degree", "2"],
    ),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The 1-process runs, trained once per module on first use."""
    runs = {}

    def get(name: str) -> list[dict]:
        if name not in runs:
            runs[name] = train(
                1, tmp_path_factory.mktemp(f"qwen3_{name}"), DENSE if name == "dense" else MOE
            )
            assert_loss_falls(runs[name])
        return runs[name]

    return get


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
COVERED_BY = {
    "fsdp2": "fsdp2_tp2",
    "tp2": "fsdp2_tp2",
    "cp2": "tp2_cp2_pp2",
    "cp2_pp2": "tp2_cp2_pp2",
    "moe_ep2": "moe_fsdp4_ep2",
}


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_parity_with_one_process(case, references, tmp_path):
    reference, nproc, dp, overrides = CASES[case]
    assert_parity(references(reference), train(nproc, tmp_path, overrides, dp=dp))
