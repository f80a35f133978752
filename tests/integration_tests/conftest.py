import pytest

from tests.parity import assert_loss_falls, train


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """The 1-process fp32 reference, trained once per test session and shared."""
    records = train(1, tmp_path_factory.mktemp("reference"))
    assert_loss_falls(records)
    return records
