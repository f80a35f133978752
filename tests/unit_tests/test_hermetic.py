"""The suite's hermeticity (tests/hermetic.py): its own machine cache, shared with the
processes it launches, the planted bf16 speed, and a failed session when a test writes the
user's cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hermetic import PLANTED_BF16_RATIOS, user_cache_folder
from torchtitan.tools.cpu_precision import matmul_speed
from torchtitan.tools.machine_cache import CACHE_ENV, cache_folder

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_session_measures_into_its_own_cache():
    assert os.environ[CACHE_ENV] and cache_folder() != user_cache_folder()
    assert cache_folder().name.startswith("torchtitan-test-cache-")


def test_a_launched_process_reads_the_sessions_bf16_speed(request):
    probe = "import torch; from torchtitan.tools.cpu_precision import matmul_speed; "
    probe += "print(matmul_speed(torch.bfloat16).ratio)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    planted = request.config.getoption("--cpu-bf16")
    expected = PLANTED_BF16_RATIOS.get(planted, matmul_speed(torch.bfloat16).ratio)
    assert float(out.stdout) == expected


def _suite(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """A one-test suite with the hermetic plugin, run with ``tmp_path`` as the home folder."""
    (tmp_path / "test_one.py").write_text(body)
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    env.pop(CACHE_ENV)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.hermetic", "-p", "no:cacheprovider"]
        + ["-p", "no:randomly", "--rootdir", str(tmp_path), str(tmp_path / "test_one.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )


WRITES_THE_USERS_CACHE = """
from pathlib import Path
def test_writes():
    folder = Path.home() / ".cache" / "torchtitan"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu_planted.json").write_text("{}")
"""

MEASURES = """
import torch
from torchtitan.tools.cpu_precision import matmul_speed
def test_measures():
    assert matmul_speed(torch.bfloat16).ratio > 0
"""


@pytest.mark.parametrize(("body", "fails"), [(WRITES_THE_USERS_CACHE, True), (MEASURES, False)])
def test_a_session_that_writes_the_users_cache_fails(tmp_path, body, fails):
    result = _suite(tmp_path, body)
    assert (result.returncode != 0) == fails, result.stdout + result.stderr
    assert ("FAILED hermeticity" in result.stdout) == fails, result.stdout
    if fails:
        assert "cpu_planted.json" in result.stdout
    assert not (tmp_path / ".cache" / "torchtitan").exists() or fails
