"""Qwen3 trains like one process (per-step loss and grad norm within 1e-4, fp32): the dense
debug model under FSDP 2, TP 2 (per-head q/k norms on sharded heads), CP 2 and PP 2, and the
MoE debug model under EP 2 (forced-balanced routing, so routing cannot flip on ties)."""

import pytest

from tests.parity import assert_loss_falls, assert_parity, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

DENSE = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--debug.moe_force_load_balance"]

# name: (reference, processes, data-parallel degree, overrides)
CASES = {
    "fsdp2": ("dense", 2, 2, DENSE),
    "tp2": ("dense", 2, 1, DENSE + ["--parallelism.tensor_parallel_degree", "2"]),
    "cp2": ("dense", 2, 1, DENSE + ["--parallelism.context_parallel_degree", "2"]),
    "pp2": ("dense", 2, 1, DENSE + ["--parallelism.pipeline_parallel_degree", "2",
                                    "--parallelism.pipeline_parallel_schedule", "1F1B"]),
    "moe_ep2": ("moe", 2, 2, MOE + ["--parallelism.expert_parallel_degree", "2"]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The 1-process runs, trained once per module on first use."""
    runs = {}

    def get(name: str) -> list[dict]:
        if name not in runs:
            runs[name] = train(1, tmp_path_factory.mktemp(f"qwen3_{name}"), DENSE if name == "dense" else MOE)
            assert_loss_falls(runs[name])
        return runs[name]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_one_process(case, references, tmp_path):
    reference, nproc, dp, overrides = CASES[case]
    assert_parity(references(reference), train(nproc, tmp_path, overrides, dp=dp))
