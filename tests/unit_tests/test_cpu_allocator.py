"""Memory a CPU tensor frees is reused by the next one instead of being faulted in and
zeroed again: counted as the process's minor page faults, in a fresh process each time
(the setting is process-wide)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from tests.launcher import REPO_ROOT

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

FIRST_BYTES, SECOND_BYTES = 256 * 2**20, 128 * 2**20  # both far above glibc's mmap threshold
PROBE = f"""
import json, resource, sys, torch
from torchtitan.tools.cpu_allocator import keep_freed_cpu_memory
applied = keep_freed_cpu_memory() if sys.argv[1] == "keep" else None
first = torch.full(({FIRST_BYTES} // 4,), 1.0)  # full: every page touched
del first
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
second = torch.full(({SECOND_BYTES} // 4,), 1.0)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({{"applied": applied, "faults": faults}}))
"""


def faults_of_the_second_tensor(mode: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    pages = SECOND_BYTES // os.sysconf("SC_PAGE_SIZE")
    kept, default = faults_of_the_second_tensor("keep"), faults_of_the_second_tensor("default")
    assert kept["applied"] is True
    assert kept["faults"] < pages // 10, kept  # served from the first tensor's pages
    assert default["faults"] >= pages, default  # glibc's default: a fresh mmap, every page again
