"""DPO trains like one process on every layout it supports: per-step loss and grad norm
(1e-4) under FSDP 2 x TP 2 (FSDP 2 and TP 2 alone with --matrix), with the frozen-copy
reference, and with LoRA's adapters-off reference (CI: it learns under FSDP 2); a run
stopped after step 5 resumes with bitwise the losses of the uninterrupted run (the
reference starts again from the starting weights, not from the resumed policy). The loss
(TRL's, checked in tests/unit_tests/test_dpo_against_trl.py) starts at ln 2, where policy
and reference agree."""

import math

import pytest

from tests.launcher import REPO_ROOT, read_metrics, run_torchrun
from tests.parity import assert_parity, ci_subset, dpo_args, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

DPO = dpo_args(str(REPO_ROOT / "tests" / "assets" / "preference_tiny.jsonl"))
LORA = [
    "--model.converters",
    "lora",
    "--lora.target_modules",
    "attention,mlp",
    "--optimizer.lr",
    "2e-2",
]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]

# name: (processes, data-parallel degree, overrides)
CASES = {
    "fsdp2": (2, 2, []),
    "tp2": (2, 1, TP2),
    "fsdp2_tp2": (4, 2, TP2),
}
COVERED_BY = {"fsdp2": "fsdp2_tp2", "tp2": "fsdp2_tp2"}


def assert_dpo_learns(records: list[dict]) -> None:
    """Policy = reference at step 1 (loss ln 2, no margin); the chosen completions' reward
    then pulls ahead of the rejected ones'."""
    assert math.isclose(records[0]["loss"], math.log(2), rel_tol=1e-6), records[0]["loss"]
    assert records[0]["rewards/margins"] == 0.0
    assert records[-1]["loss"] < records[0]["loss"] - 0.02
    assert records[-1]["rewards/margins"] > 0.03
    assert records[-1]["pairs"] == 24  # 8 sequences of 64 tokens, 3 whole pairs each


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    records = train(1, tmp_path_factory.mktemp("dpo_reference"), DPO)
    assert_dpo_learns(records)
    return records


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_parity_with_one_process(case, reference_run, tmp_path):
    nproc, dp, overrides = CASES[case]
    assert_parity(reference_run, train(nproc, tmp_path, DPO + overrides, dp=dp))


def test_a_stopped_run_resumes_with_the_same_losses(reference_run, tmp_path):
    checkpoints = ["--checkpoint.enable", "--checkpoint.interval", "5"]
    stopped = train(1, tmp_path, DPO + checkpoints + ["--debug.stop_after_step", "5"])
    assert [r["step"] for r in stopped] == [1, 2, 3, 4, 5]
    resumed = train(1, tmp_path, DPO + checkpoints)[5:]
    assert [r["step"] for r in resumed] == list(range(6, 11))
    for ours, straight in zip(resumed, reference_run[5:]):
        assert (ours["loss"], ours["grad_norm"]) == (straight["loss"], straight["grad_norm"])


def test_lora_with_the_base_as_reference_learns_under_fsdp2(tmp_path):
    """The adapters-off reference: ln 2 at step 1, then a margin (with the adapters left on
    the reference would follow the policy and the loss stay at ln 2). LoRA under FSDP is
    parity-checked in test_parity_lora.py; the DPO pair of both in the matrix below."""
    assert_dpo_learns(train(2, tmp_path, DPO + LORA))


@pytest.mark.matrix
def test_lora_with_the_base_as_reference_trains_like_one_process(tmp_path):
    one = train(1, tmp_path / "one", DPO + LORA)
    assert_dpo_learns(one)
    assert_parity(one, train(2, tmp_path / "fsdp2", DPO + LORA))


def test_the_reference_starts_from_the_loaded_hugging_face_weights(tmp_path):
    """A Hugging Face folder through the hf backend: the reference gets the folder's
    weights as the policy does, so the first loss is ln 2 (from its seeded initialisation,
    a planted error, it is not)."""
    args = [
        "--job.config_file",
        str(REPO_ROOT / "train_configs" / "hf_debug.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "1",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--checkpoint.interval",
        "1000",
        "--metrics.log_freq",
        "1",
        *DPO,
    ]
    run_torchrun(1, args)
    (first,) = read_metrics(tmp_path)
    assert math.isclose(first["loss"], math.log(2), rel_tol=1e-6), first["loss"]
