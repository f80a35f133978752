"""scripts/gpu_check.sh on a machine without a GPU: it stops at once with one FAIL line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.launcher import REPO_ROOT


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_check_fails_fast_without_a_cuda_device(tmp_path):
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=REPO_ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("FAIL: no CUDA device ("), result.stdout + result.stderr
    assert len(result.stdout.splitlines()) == 1, result.stdout
    assert not (tmp_path / "out").exists()  # nothing ran
