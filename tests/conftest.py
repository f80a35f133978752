import pytest
import torch

pytest_plugins = ["tests.hermetic"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--matrix",
        action="store_true",
        help="also run the tests marked matrix (a feature's whole layout matrix; CI runs a "
        "subset of it, each matrix file says which)",
    )


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--matrix"):
        skip_matrix = pytest.mark.skip(reason="the layout matrix: run with --matrix")
        for item in items:
            if "matrix" in item.keywords:
                item.add_marker(skip_matrix)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_ALLOCATOR_SETTING_APPLIED: list[bool] = []


@pytest.fixture(scope="session", autouse=True)
def _cpu_allocator_setting_never_applied_here():
    """training.cpu_keep_freed_memory changes glibc's malloc for the whole process and cannot
    be undone, so a test that trains in the pytest process turns it off
    (--training.no-cpu_keep_freed_memory): the tests after it must see glibc's defaults. It
    is never applied in this process (session-wide, so fixtures of any scope are covered)."""
    from torchtitan.tools import cpu_allocator

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            cpu_allocator,
            "keep_freed_cpu_memory",
            lambda: _ALLOCATOR_SETTING_APPLIED.append(True) or False,
        )
        yield


@pytest.fixture(autouse=True)
def _cpu_allocator_untouched_by_this_test():
    """A test (or a fixture it set up) that would have applied the setting fails."""
    yield
    applied = bool(_ALLOCATOR_SETTING_APPLIED)
    _ALLOCATOR_SETTING_APPLIED.clear()
    assert not applied, (
        "training.cpu_keep_freed_memory was applied in the pytest process; "
        "pass --training.no-cpu_keep_freed_memory to in-process runs"
    )
