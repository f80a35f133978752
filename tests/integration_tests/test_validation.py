"""Validation under FSDP, HSDP, FSDP x TP, CP, PP and (DeepSeek-V3) EP gives the 1-process
validation loss, every validation.freq steps, and does not disturb training.

Every layout validates on the same 16 global sequences per pass (4 steps x 4 sequences in
one process; the local batch shrinks with the data-parallel degree, as the parity harness
does for training). Under PP the validation batch is the training batch (2 steps x 8).
"""

import json
import math

import pytest

from tests.layouts import HSDP_2X2
from tests.parity import RTOL, assert_parity, ci_subset, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

VALIDATION_SEQUENCES = 4  # per batch in one process
VALIDATION_STEPS = 4


def _validation_overrides(dp: int, batches: int) -> list[str]:
    return [
        "--validation.enable",
        "--validation.freq",
        "5",
        "--validation.seq_len",
        "64",
        "--validation.local_batch_size",
        str(VALIDATION_SEQUENCES * VALIDATION_STEPS // (batches * dp)),
        "--validation.steps",
        str(batches),
    ]


def _run(
    nproc: int, dp: int, folder, overrides: list[str] = (), batches: int = VALIDATION_STEPS
) -> tuple[list[dict], list[dict]]:
    metrics = train(nproc, folder, _validation_overrides(dp, batches) + list(overrides), dp=dp)
    with open(folder / "validation.jsonl") as f:
        return metrics, [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _run(1, 1, tmp_path_factory.mktemp("validation_1"))


# case: (processes, dp degree, overrides, validation batches per pass)
CASES = {
    "fsdp2": (2, 2, [], VALIDATION_STEPS),
    "hsdp2x2": (4, 4, HSDP_2X2, VALIDATION_STEPS),
    "fsdp2_tp2": (
        4,
        2,
        ["--parallelism.tensor_parallel_degree", "2"],
        VALIDATION_STEPS,
    ),  # loss parallel
    "cp2": (2, 1, ["--parallelism.context_parallel_degree", "2"], VALIDATION_STEPS),
    "pp2": (
        2,
        1,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ],
        2,
    ),
}


def test_one_process_validates_every_freq_steps(one_process, reference_run) -> None:
    metrics, validation = one_process
    assert [r["step"] for r in validation] == [5, 10]
    assert validation[1]["validation_loss"] < validation[0]["validation_loss"]
    for record in validation:
        assert record["validation_perplexity"] == pytest.approx(math.exp(record["validation_loss"]))
    assert_parity(reference_run, metrics)  # validating changes nothing in training


def _assert_same_validation(
    reference_run: tuple[list[dict], list[dict]], run: tuple[list[dict], list[dict]]
) -> None:
    (reference_metrics, reference), (metrics, validation) = reference_run, run
    assert_parity(reference_metrics, metrics)
    assert [r["step"] for r in validation] == [r["step"] for r in reference]
    for ref, got in zip(reference, validation):
        assert math.isclose(
            got["validation_loss"], ref["validation_loss"], rel_tol=RTOL, abs_tol=0.0
        ), (
            f"step {ref['step']}: validation loss {got['validation_loss']!r} vs one process "
            f"{ref['validation_loss']!r}"
        )


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
COVERED_BY = {
    "fsdp2": "fsdp2_tp2",
}


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_validation_loss_matches_one_process(case, one_process, tmp_path) -> None:
    nproc, dp, overrides, batches = CASES[case]
    _assert_same_validation(one_process, _run(nproc, dp, tmp_path, overrides, batches))


# Forced-balanced routing, as the expert-parallel parity tests use.
DEEPSEEK = [
    "--model.name",
    "deepseek_v3",
    "--model.flavor",
    "debugmodel",
    "--debug.moe_force_load_balance",
]


def test_validation_under_expert_parallel_matches_one_process(tmp_path) -> None:
    reference = _run(1, 1, tmp_path / "one_process", DEEPSEEK)
    ep2 = _run(2, 2, tmp_path / "ep2", DEEPSEEK + ["--parallelism.expert_parallel_degree", "2"])
    _assert_same_validation(reference, ep2)
