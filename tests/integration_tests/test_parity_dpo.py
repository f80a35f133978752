"""DPO trains like one process on every layout it supports: per-step loss and grad norm
(1e-4), pairs and rewards under FSDP 2 x TP 2, FSDP 2 x PP 2 and FSDP 2 x CP 2 (FSDP 2,
TP 2, PP 2, CP 2, TP 2 x PP 2 and another schedule alone with --matrix), with the
frozen-copy reference, and with LoRA's adapters-off reference (CI: it learns under FSDP 2);
a run stopped after step 5 resumes with bitwise the losses of the uninterrupted run (the
reference starts again from the starting weights, not from the resumed policy). The loss
(TRL's, checked in tests/unit_tests/test_dpo_against_trl.py) starts at ln 2, where policy
and reference agree."""

import math

import pytest

from tests.launcher import REPO_ROOT, read_metrics, run_torchrun
from tests.parity import QLORA, assert_parity, ci_subset, dpo_args, train, train_args

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
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
CP2 = ["--parallelism.context_parallel_degree", "2"]

# name: (processes, data-parallel degree, overrides)
CASES = {
    "fsdp2": (2, 2, []),
    "tp2": (2, 1, TP2),
    "fsdp2_tp2": (4, 2, TP2),
    "pp2": (2, 1, PP2),
    "pp2_interleaved_1f1b": (2, 1, PP2 + INTERLEAVED),
    "tp2_pp2": (4, 1, TP2 + PP2),
    "fsdp2_pp2": (4, 2, PP2),
    "cp2": (2, 1, CP2),
    "fsdp2_cp2": (4, 2, CP2),
}
COVERED_BY = {
    "fsdp2": "fsdp2_tp2",
    "tp2": "fsdp2_tp2",
    "pp2": "fsdp2_pp2",
    "pp2_interleaved_1f1b": "fsdp2_pp2",
    "tp2_pp2": "fsdp2_tp2",
    "cp2": "fsdp2_cp2",
}


def assert_dpo_learns(records: list[dict]) -> None:
    """Policy = reference at step 1 (loss ln 2, no margin); the chosen completions' reward
    then pulls ahead of the rejected ones'."""
    assert math.isclose(records[0]["loss"], math.log(2), rel_tol=1e-6), records[0]["loss"]
    assert records[0]["rewards/margins"] == 0.0
    assert records[-1]["loss"] < records[0]["loss"] - 0.02
    assert records[-1]["rewards/margins"] > 0.03
    assert records[-1]["pairs"] == 24  # 8 sequences of 64 tokens, 3 whole pairs each


def assert_same_preference_metrics(reference: list[dict], other: list[dict]) -> None:
    """Pairs equal, rewards within 1e-5 (each pair counted once: a pipeline schedule's
    stand-in loss call at its first step is not a micro-batch). Accuracies are not compared:
    at step 1 every reward is 0 up to rounding, which decides the ties."""
    for ours, theirs in zip(other, reference):
        assert ours["pairs"] == theirs["pairs"], (ours["step"], ours["pairs"], theirs["pairs"])
        for name in ("rewards/chosen", "rewards/rejected"):
            assert math.isclose(ours[name], theirs[name], abs_tol=1e-5), (ours["step"], name)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    records = train(1, tmp_path_factory.mktemp("dpo_reference"), DPO)
    assert_dpo_learns(records)
    return records


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_parity_with_one_process(case, reference_run, tmp_path):
    nproc, dp, overrides = CASES[case]
    records = train(nproc, tmp_path, DPO + overrides, dp=dp)
    assert_parity(reference_run, records)
    assert_same_preference_metrics(reference_run, records)


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


def test_qlora_with_the_nf4_base_as_reference_learns_under_fsdp2(tmp_path):
    """QLoRA's reference is the NF4 base with the adapters off (no copy): ln 2 at step 1,
    then a margin."""
    out = run_torchrun(
        2, train_args(2, tmp_path, DPO + QLORA + ["--lora.rank", "4", "--optimizer.lr", "1e-2"])
    ).stdout
    assert "adapted linears are NF4 now" in out, out[-3000:]
    assert_dpo_learns(read_metrics(tmp_path))


@pytest.mark.matrix
def test_lora_with_the_base_as_reference_trains_like_one_process(tmp_path):
    one = train(1, tmp_path / "one", DPO + LORA)
    assert_dpo_learns(one)
    assert_parity(one, train(2, tmp_path / "fsdp2", DPO + LORA))
    assert_parity(one, train(2, tmp_path / "pp2", DPO + LORA + PP2, dp=1))


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
        # fp32 on any host: policy and reference agree to the bit only there
        "--training.mixed_precision_param",
        "float32",
        *DPO,
    ]
    run_torchrun(1, args)
    (first,) = read_metrics(tmp_path)
    assert math.isclose(first["loss"], math.log(2), rel_tol=1e-6), first["loss"]
