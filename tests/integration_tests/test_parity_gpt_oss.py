"""gpt-oss trains like one process (per-step loss and grad norm within 1e-4, fp32): the debug
model (sinks, alternating 16-token windows, biased clamped-SwiGLU experts; forced-balanced
routing, so routing cannot flip on ties) under FSDP 2, TP 2 (sinks sharded with the heads),
PP 2, EP 2, FSDP 2 x EP 2 and TP 2 x EP 2; with packed documents (``block_causal`` with the
window) under FSDP 2."""

import pytest

from tests.parity import assert_loss_falls, assert_parity, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

GPT_OSS = [
    "--model.name",
    "gpt_oss",
    "--model.flavor",
    "debugmodel",
    "--debug.moe_force_load_balance",
]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]

# name: (processes, data-parallel degree, overrides)
CASES = {
    "fsdp2": (2, 2, []),
    "tp2": (2, 1, TP2),
    "pp2": (2, 1, PP2),
    "ep2": (2, 2, EP2),
    "fsdp2_ep2": (4, 4, EP2),
    "tp2_ep2": (4, 2, TP2 + EP2),
}
BLOCK_CAUSAL = ["--model.attn_type", "flex", "--model.attn_mask_type", "block_causal"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    records = train(1, tmp_path_factory.mktemp("gpt_oss_reference"), GPT_OSS)
    assert_loss_falls(records)
    return records


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_one_process(case, reference, tmp_path):
    nproc, dp, overrides = CASES[case]
    assert_parity(reference, train(nproc, tmp_path, GPT_OSS + overrides, dp=dp))


def test_block_causal_with_windows_under_fsdp2(tmp_path):
    reference = train(1, tmp_path / "one", GPT_OSS + BLOCK_CAUSAL)
    assert_parity(reference, train(2, tmp_path / "fsdp2", GPT_OSS + BLOCK_CAUSAL, dp=2))
