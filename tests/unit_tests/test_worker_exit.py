"""How a worker process ends: its exit status as ``sys.exit`` gives it, its exit handlers
run, and the interpreter's finalization (where torch 2.13's gloo sometimes aborts) does not."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.launcher import REPO_ROOT

WORKER = """
import atexit, sys
from torchtitan.distributed.process import run_worker_entry_point

class Finalized:
    def __del__(self):
        print("finalized", flush=True)

KEPT_UNTIL_FINALIZATION = Finalized()
atexit.register(lambda: print("exit handlers ran", flush=True))

def main():
    print("main ran", end="\\n")  # buffered: must still reach the pipe
    {body}

run_worker_entry_point(main)
"""


def run_worker(body: str) -> subprocess.CompletedProcess:
    source = textwrap.dedent(WORKER).format(body=body)
    return subprocess.run(
        [sys.executable, "-c", source], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, status, stderr",
    [
        ("return None", 0, ""),
        ("return 3", 3, ""),
        ("sys.exit(2)", 2, ""),
        ("sys.exit(None)", 0, ""),
        ("sys.exit('stopped: reason')", 1, "stopped: reason\n"),
    ],
)
def test_exit_status_as_sys_exit_would_give_it_without_finalization(body, status, stderr):
    result = run_worker(body)
    assert result.returncode == status, result.stderr
    assert result.stdout == "main ran\nexit handlers ran\n"
    assert result.stderr == stderr


@pytest.mark.slow
def test_an_uncaught_exception_keeps_its_traceback():
    result = run_worker("raise ValueError('broken')")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ValueError: broken" in result.stderr
