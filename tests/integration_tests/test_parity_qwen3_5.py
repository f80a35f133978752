"""Qwen3.5 trains like one process (per-step loss and grad norm within 1e-4, fp32): the debug
model (three Gated DeltaNet layers, then one gated full-attention layer; delta-rule chunks of
16 tokens) under FSDP 2, TP 2 (both mixers' heads sharded), PP 2 and FSDP 2 x TP 2; context
parallel over 2 and 4 ranks (the linear layers hand their recurrent state and convolution
tail from rank to rank, the attention layer keeps its CP method), also with packed documents
(``block_causal``: the state and convolution restart at each document); the MoE debug model
(gated shared expert; forced-balanced routing) under EP 2 and TP 2 x EP 2 x ETP 2."""

import pytest

from tests.parity import assert_loss_falls, assert_parity, ci_subset, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

QWEN3_5 = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel"]
MOE = [
    "--model.name",
    "qwen3_5",
    "--model.flavor",
    "debugmodel_moe",
    "--debug.moe_force_load_balance",
]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
BLOCK_CAUSAL = ["--model.attn_type", "flex", "--model.attn_mask_type", "block_causal"]


def cp(degree: int) -> list[str]:
    return ["--parallelism.context_parallel_degree", str(degree)]


# name: (processes, data-parallel degree, overrides)
CASES = {
    "fsdp2": (2, 2, []),
    "tp2": (2, 1, TP2),
    "pp2": (2, 1, ["--parallelism.pipeline_parallel_degree", "2"]),
    "fsdp2_tp2": (4, 2, TP2),
    "cp2": (2, 1, cp(2)),
    "cp4": (4, 1, cp(4)),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The 1-process runs by their overrides, trained once per module on first use."""
    runs = {}

    def get(*overrides: str) -> list[dict]:
        if overrides not in runs:
            runs[overrides] = train(1, tmp_path_factory.mktemp("qwen3_5_one"), list(overrides))
            assert_loss_falls(runs[overrides])
        return runs[overrides]

    return get


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
COVERED_BY = {
    "tp2": "fsdp2_tp2",
    "cp2": "cp4",
}


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_parity_with_one_process(case, references, tmp_path):
    nproc, dp, overrides = CASES[case]
    assert_parity(references(*QWEN3_5), train(nproc, tmp_path, QWEN3_5 + overrides, dp=dp))


def test_context_parallel_with_packed_documents(references, tmp_path):
    run = train(2, tmp_path, QWEN3_5 + BLOCK_CAUSAL + cp(2), dp=1)
    assert_parity(references(*QWEN3_5, *BLOCK_CAUSAL), run)


EP2 = ["--parallelism.expert_parallel_degree", "2"]
MOE_CASES = {
    "ep2": (2, 2, EP2),
    # the shared expert's hidden dim split over tp: its gate scales partial sums
    "tp2_ep2_etp2": (4, 2, TP2 + EP2 + ["--parallelism.expert_tensor_parallel_degree", "2"]),
}


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
MOE_COVERED_BY = {
    "ep2": "tp2_ep2_etp2",
}


@pytest.mark.parametrize("case", ci_subset(MOE_CASES, MOE_COVERED_BY))
def test_moe_with_expert_parallel(case, references, tmp_path):
    nproc, dp, overrides = MOE_CASES[case]
    assert_parity(references(*MOE), train(nproc, tmp_path, MOE + overrides, dp=dp))
