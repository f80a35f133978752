"""Float8 training (torchao, emulated on CPU) on the parity harness's tiny Llama 3: its loss
stays close to the high-precision reference, and FSDP 2 with float8 all-gather and TP 2 give
the 1-process float8 losses and grad norms (10 steps, the reference's schedule).

Tolerances. A float8 e4m3 number has 3 mantissa bits, so one cast rounds by up to 6 %.
Activations are scaled per forward call, so a layout that splits the batch (FSDP 2: 4
samples per rank) casts them with other scales, and fp32 reduction orders (~1e-7) flip the
rounding of a few weight elements. Observed (10 steps): FSDP 2 vs 1 process 2.1e-4 (loss) and
1.0e-3 (grad norm), TP 2 1.8e-5 and 3.7e-4; hence ``FLOAT8_RTOL`` 3e-3. Scales not recomputed
after the optimizer step move the loss by 2.7e-3 at step 5 and 1.4e-2 at step 10, and the
grad norm by 7.7e-3 at step 5. Against the high-precision reference the float8 loss stays
within 1.3e-3 (10 steps); ``VS_HIGH_PRECISION_RTOL`` 2e-2 is the "few percent" of the issue."""

import pytest

from tests.parity import ParityError, assert_parity, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

FLOAT8 = ["--model.converters", "float8", "--quantize.linear.float8.emulate"]
FSDP_FLOAT8 = FLOAT8 + [
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
]
STALE_SCALES = ["--experimental.custom_import", "tests.integration_tests.stale_float8_scales"]
FLOAT8_RTOL = 3e-3
VS_HIGH_PRECISION_RTOL = 2e-2


@pytest.fixture(scope="module")
def float8_run(tmp_path_factory):
    return train(1, tmp_path_factory.mktemp("float8"), FLOAT8)


def test_float8_loss_stays_close_to_high_precision(float8_run, reference_run):
    assert_parity(reference_run, float8_run, rtol=VS_HIGH_PRECISION_RTOL)
    # identical numbers would mean that no linear ran in float8
    assert any(r["loss"] != f["loss"] for r, f in zip(reference_run, float8_run))


@pytest.mark.parametrize("case", ["fsdp2_float8_all_gather", "tp2"])
def test_float8_layouts_match_one_process(case, float8_run, tmp_path):
    if case == "tp2":
        records = train(2, tmp_path, FLOAT8 + ["--parallelism.tensor_parallel_degree", "2"], dp=1)
    else:
        records = train(2, tmp_path, FSDP_FLOAT8)
    assert_parity(float8_run, records, rtol=FLOAT8_RTOL)


def test_planted_stale_float8_scales_fail_parity(float8_run, tmp_path):
    planted = train(2, tmp_path, FSDP_FLOAT8 + STALE_SCALES)
    with pytest.raises(ParityError):
        assert_parity(float8_run, planted, rtol=FLOAT8_RTOL)
