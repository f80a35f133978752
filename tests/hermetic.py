"""Keeps the suite hermetic (a pytest plugin, loaded by tests/conftest.py).

* Every session measures the machine into its own temporary cache (``$TORCHTITAN_CACHE``,
  exported so that every torchrun the tests launch uses it too), never into the user's
  ``~/.cache/torchtitan``; the session fails if that folder changed while it ran.
* ``--cpu-bf16 native|emulated`` plants the CPU's bf16 matmul speed in that cache, so the
  tests that follow the CPU precision decision (training.cpu_low_precision, Muon's auto
  ns_dtype, estimates for a CPU target) run as on a CPU that has bf16 matmul instructions or
  on one that emulates them, whatever this host is. ``python -m tests.hermetic`` prints the
  way this host is not (what scripts/test.sh fakes in its second pass).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from torchtitan.tools.cpu_precision import (
    NATIVE_RATIO,
    measure_matmul_ratio,
    ratio_measurement_name,
)
from torchtitan.tools.machine_cache import CACHE_ENV, record_measurement

PLANTED_BF16_RATIOS = {"native": 2.0, "emulated": 0.012}
"""bf16 / fp32 matmul speed planted per option (measured: 1.7-2.4 with AVX-512 BF16, ~0.012
emulated with AVX2 only, on 2-core EPYCs)."""

_SESSION_CACHE = pytest.StashKey[Path]()
_HOME_BEFORE = pytest.StashKey[dict]()


def user_cache_folder() -> Path:
    return Path.home() / ".cache" / "torchtitan"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-bf16",
        choices=("measured", *PLANTED_BF16_RATIOS),
        default="measured",
        help="the CPU's bf16 matmul speed as the session's machine cache says it: measured on "
        "this CPU (default), or planted native / emulated",
    )


def _is_worker(config: pytest.Config) -> bool:
    """An xdist worker inherits the controller's cache folder through the environment."""
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if _is_worker(config):
        return
    config.stash[_HOME_BEFORE] = _snapshot(user_cache_folder())
    folder = Path(tempfile.mkdtemp(prefix="torchtitan-test-cache-"))
    os.environ[CACHE_ENV] = str(folder)
    config.stash[_SESSION_CACHE] = folder
    planted = config.getoption("--cpu-bf16")
    if planted != "measured":
        record_measurement(
            ratio_measurement_name(torch.bfloat16),
            PLANTED_BF16_RATIOS[planted],
            per_thread_count=False,
        )


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"machine measurements: {os.environ[CACHE_ENV]} (this session's own; cpu bf16 "
        f"{config.getoption('--cpu-bf16')})"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _is_worker(config):
        return
    shutil.rmtree(config.stash[_SESSION_CACHE], ignore_errors=True)
    before, after = config.stash[_HOME_BEFORE], _snapshot(user_cache_folder())
    if before != after:
        changed = sorted(set(before.items()) ^ set(after.items()))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        reporter.ensure_newline()
        reporter.write_line(
            f"FAILED hermeticity: the suite changed {user_cache_folder()} "
            f"({', '.join(name for name, _ in changed)}); tests must use $TORCHTITAN_CACHE",
            red=True,
        )


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Each file under ``folder``: (size, modification time in ns)."""
    if not folder.is_dir():
        return {}
    return {
        str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def other_bf16_than_this_host() -> str:
    """``native`` where this CPU emulates bf16 matmuls, else ``emulated``."""
    return "native" if measure_matmul_ratio(torch.bfloat16) < NATIVE_RATIO else "emulated"


if __name__ == "__main__":
    print(other_bf16_than_this_host())
