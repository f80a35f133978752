"""FSDP / HSDP / DDP / gradient accumulation give the 1-process losses and grad norms."""

import pytest

from tests.layouts import DDP_2, HSDP_2X2
from tests.parity import ParityError, assert_parity, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

CASES = {
    "fsdp2": (2, []),
    "fsdp4": (4, []),
    "hsdp2x2": (4, HSDP_2X2),
    "ddp2": (2, DDP_2),
    # global 8 = 2 micro-batches x local 2 x dp 2
    "grad_accum_fsdp2": (2, ["--training.local_batch_size", "2"]),
    "reshard_always": (2, ["--parallelism.fsdp_reshard_after_forward", "always"]),
    "reshard_never": (2, ["--parallelism.fsdp_reshard_after_forward", "never"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_one_process(case, reference_run, tmp_path):
    nproc, overrides = CASES[case]
    assert_parity(reference_run, train(nproc, tmp_path, overrides))


def test_grad_accumulation_on_one_process(reference_run, tmp_path):
    assert_parity(reference_run, train(1, tmp_path, ["--training.local_batch_size", "4"]))


def test_negative_control_planted_lr_change_is_detected(reference_run, tmp_path):
    """lr x 2 must fail the same comparison: a check that cannot fail is no check."""
    planted = train(2, tmp_path, ["--optimizer.lr", "6e-3"])
    with pytest.raises(ParityError):
        assert_parity(reference_run, planted)
