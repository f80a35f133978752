"""gpt-oss trains like one process (per-step loss and grad norm within 1e-4, fp32): the debug
model (sinks, alternating 16-token windows, biased clamped-SwiGLU experts; forced-balanced
routing, so routing cannot flip on ties) under FSDP 2, TP 2 (sinks sharded with the heads),
PP 2, EP 2, FSDP 2 x EP 2 and TP 2 x EP 2 x ETP 2 (the experts' output bias added once
over the partial sums); CP 2 with each rotate method, the 16-token
window spanning several CP chunks (seq 32: chunks of 8) and within one (seq 128: chunks of
32), the sink counted once per query; with packed documents (``block_causal`` with the
window) under FSDP 2 and CP 2."""

import pytest

from tests.parity import assert_loss_falls, assert_parity, ci_subset, train

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
    "tp2_ep2_etp2": (4, 2, TP2 + EP2 + ["--parallelism.expert_tensor_parallel_degree", "2"]),
}
BLOCK_CAUSAL = ["--model.attn_type", "flex", "--model.attn_mask_type", "block_causal"]


# name: (sequence length, rotate method)
CP_CASES = {
    f"{method}_window_{where}": (length, method)
    for method in ("allgather", "alltoall", "ulysses")
    for where, length in (("over_chunks", 32), ("within_a_chunk", 128))
}


def seq(length: int) -> list[str]:
    return ["--training.seq_len", str(length)]


def cp2(method: str) -> list[str]:
    return [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_rotate_method",
        method,
    ]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The 1-process runs by their extra overrides, trained once per module on first use."""
    runs = {}

    def get(*extra: str) -> list[dict]:
        if extra not in runs:
            runs[extra] = train(1, tmp_path_factory.mktemp("gpt_oss_one"), GPT_OSS + list(extra))
            assert_loss_falls(runs[extra])
        return runs[extra]

    return get


@pytest.fixture
def reference(references):
    return references()


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
COVERED_BY = {
    "tp2": "tp2_ep2_etp2",
}


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_parity_with_one_process(case, reference, tmp_path):
    nproc, dp, overrides = CASES[case]
    assert_parity(reference, train(nproc, tmp_path, GPT_OSS + overrides, dp=dp))


@pytest.mark.parametrize("case", list(CP_CASES))
def test_context_parallel_with_windows_and_sinks(case, references, tmp_path):
    length, method = CP_CASES[case]
    overrides = GPT_OSS + seq(length) + cp2(method)
    assert_parity(references(*seq(length)), train(2, tmp_path, overrides))


@pytest.mark.parametrize("layout", ["fsdp2", "cp2"])
def test_block_causal_with_windows(layout, references, tmp_path):
    extra = ["--parallelism.context_parallel_degree", "2"] if layout == "cp2" else []
    run = train(2, tmp_path, GPT_OSS + BLOCK_CAUSAL + extra, dp=2 if layout == "fsdp2" else 1)
    assert_parity(references(*BLOCK_CAUSAL), run)
