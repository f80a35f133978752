import pytest

from tests.parity import FULL_LOGITS, assert_loss_falls, train


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """The 1-process fp32 reference on the full logits (every layout compared with it runs
    the default chunked loss), trained once per test session and shared."""
    records = train(1, tmp_path_factory.mktemp("reference"), FULL_LOGITS)
    assert_loss_falls(records)
    return records
