"""Block-causal FlexAttention and the global-token-mean loss under every layout: the tiny
Llama 3 fine-tuned on the packed SFT jsonl (several samples per sequence, prompt tokens
labelled IGNORE_INDEX, so micro-batches hold different numbers of valid tokens) gives the
1-process losses and grad norms under FSDP, TP, each CP method, PP, FSDP x TP, CP x PP,
TP x CP x PP and gradient accumulation, with the same validation losses; the MoE model does
under EP. A per-micro-batch mean must fail the check."""

from __future__ import annotations

import json

import pytest

from tests.launcher import REPO_ROOT
from tests.parity import RTOL, ParityError, assert_loss_falls, assert_parity, ci_subset, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SFT_FILE = str(REPO_ROOT / "tests" / "assets" / "sft_tiny.jsonl")
SFT = [
    "--training.dataset",
    "sft",
    "--training.dataset_path",
    SFT_FILE,
    "--model.attn_type",
    "flex",
    "--model.attn_mask_type",
    "block_causal",
    "--training.steps",
    "6",
    "--training.data_shards",
    "4",
]
CP = "--parallelism.context_parallel_degree"
TP = "--parallelism.tensor_parallel_degree"
PP = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "1F1B",
]

CASES = {
    "fsdp2": (2, 2, []),
    "tp2": (2, 1, [TP, "2"]),
    "cp2_allgather": (2, 1, [CP, "2", "--parallelism.context_parallel_rotate_method", "allgather"]),
    "cp2_alltoall": (2, 1, [CP, "2", "--parallelism.context_parallel_rotate_method", "alltoall"]),
    "cp2_ulysses": (2, 1, [CP, "2", "--parallelism.context_parallel_rotate_method", "ulysses"]),
    "pp2": (2, 1, PP),
    "fsdp2_tp2": (4, 2, [TP, "2"]),
    "cp2_pp2": (4, 1, [CP, "2", *PP]),
    "tp2_cp2_pp2_alltoall": (
        8,
        1,
        [TP, "2", CP, "2", "--parallelism.context_parallel_rotate_method", "alltoall", *PP],
    ),
    # global 8 = 4 micro-batches x local 2
    "grad_accum4": (1, 1, ["--training.local_batch_size", "2"]),
}


def validation(dp: int) -> list[str]:
    """Two validation passes (steps 3 and 6) over the same 16 sequences on any dp degree."""
    return [
        "--validation.enable",
        "--validation.dataset",
        "sft",
        "--validation.dataset_path",
        SFT_FILE,
        "--validation.freq",
        "3",
        "--validation.seq_len",
        "64",
        "--validation.data_shards",
        "4",
        "--validation.local_batch_size",
        str(8 // dp),
        "--validation.steps",
        "2",
    ]


def validation_losses(folder) -> list[float]:
    with open(folder / "validation.jsonl") as f:
        return [json.loads(line)["validation_loss"] for line in f]


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_reference")
    records = train(1, folder, SFT + validation(1))
    assert_loss_falls(records)
    assert len({r["valid_tokens"] for r in records}) > 1, "steps should differ in valid tokens"
    return records, validation_losses(folder)


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
COVERED_BY = {
    "fsdp2": "fsdp2_tp2",
    "tp2": "fsdp2_tp2",
    "pp2": "cp2_pp2",
    "cp2_alltoall": "tp2_cp2_pp2_alltoall",
}


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_parity_with_one_process(case, sft_reference, tmp_path):
    nproc, dp, overrides = CASES[case]
    reference, reference_validation = sft_reference
    records = train(nproc, tmp_path, SFT + validation(dp) + overrides, dp=dp)
    assert_parity(reference, records)
    assert [r["valid_tokens"] for r in records] == [r["valid_tokens"] for r in reference]
    assert validation_losses(tmp_path) == pytest.approx(reference_validation, rel=RTOL)


def test_negative_control_per_microbatch_mean_is_detected(sft_reference, tmp_path):
    planted = [
        "--training.local_batch_size",
        "2",
        "--experimental.custom_import",
        "tests.integration_tests.per_microbatch_mean",
    ]
    with pytest.raises(ParityError):
        assert_parity(sft_reference[0], train(1, tmp_path, SFT + planted))


MOE = [
    "--model.name",
    "deepseek_v3",
    "--model.flavor",
    "debugmodel",
    "--debug.moe_force_load_balance",
]


def test_expert_parallel_parity_with_one_process(tmp_path):
    reference = train(1, tmp_path / "reference", SFT + MOE)
    assert_parity(
        reference,
        train(2, tmp_path / "ep2", SFT + MOE + ["--parallelism.expert_parallel_degree", "2"]),
    )
