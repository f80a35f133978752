"""Tensor (+ sequence, loss) parallel, activation checkpointing and torch.compile give the
1-process losses and grad norms."""

import os

import pytest

from tests.parity import assert_parity, ci_subset, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

TP2 = ["--parallelism.tensor_parallel_degree", "2"]

CASES = {
    "tp2": (2, 1, TP2),
    "tp4": (4, 1, ["--parallelism.tensor_parallel_degree", "4"]),
    "fsdp2_tp2": (4, 2, TP2),
    "hsdp2x2_tp2": (8, 4, TP2 + ["--parallelism.data_parallel_replicate_degree", "2"]),
    "tp2_no_loss_parallel": (2, 1, TP2 + ["--parallelism.disable_loss_parallel"]),
    "fsdp2_tp2_ac_full": (4, 2, TP2 + ["--activation_checkpoint.mode", "full"]),
}


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
COVERED_BY = {
    "fsdp2_tp2": "hsdp2x2_tp2",
    "tp2": "tp4",
}


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_parity_with_one_process(case, reference_run, tmp_path):
    nproc, dp, overrides = CASES[case]
    assert_parity(reference_run, train(nproc, tmp_path, overrides, dp=dp))


AC_MODES = {
    "full": ["--activation_checkpoint.mode", "full"],
    "selective_every_2nd_block": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    ],
    "selective_every_2nd_block_recomputing_attention": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
        "--activation_checkpoint.save_attention_output",
        "never",
    ],
    "selective_op": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
}


@pytest.mark.parametrize("mode", list(AC_MODES))
def test_activation_checkpointing_matches(mode, reference_run, tmp_path):
    assert_parity(reference_run, train(1, tmp_path, AC_MODES[mode]))


@pytest.fixture
def inductor_cache(tmp_path_factory):
    """One inductor cache for all compile tests so CI compiles each graph once."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(
        tmp_path_factory.getbasetemp().parent / "torchtitan-inductor-cache"
    )
    return {"TORCHINDUCTOR_CACHE_DIR": cache}


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_compile_matches(layout, reference_run, tmp_path, inductor_cache):
    """Per-block compile (and compiled loss) under FSDP 2 and under TP 2 (whose first block
    gets the embedding's all-gather still in flight) matches the eager 1-process run."""
    overrides = TP2 if layout == "tp2" else []
    records = train(
        2,
        tmp_path,
        ["--compile.enable", *overrides],
        dp=2 if layout == "fsdp2" else 1,
        env=inductor_cache,
        timeout=380,
    )
    assert_parity(reference_run, records)
