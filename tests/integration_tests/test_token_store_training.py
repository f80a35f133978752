"""Prepare -> train -> stop -> resume on a shuffled token store of the embedded corpus (tiny
Llama 3, fp32, gloo): under FSDP 2 steps 11-20 are bitwise those of the uninterrupted run,
and the same checkpoint resumed under FSDP 4 (dp 2 -> 4) trains on the same global batches
(loss and grad norm within the parity tolerance)."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT, read_metrics, run_torchrun
from tests.parity import RTOL, train_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STEPS, RESUME_AT = 20, 10


@pytest.fixture(scope="module")
def store_args(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("store") / "stdlib"
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "data" / "prepare.py"),
            "--dataset",
            "python_stdlib",
            "--out",
            str(out),
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return [
        "--training.dataset",
        "tokens",
        "--training.dataset_path",
        str(out),
        "--training.shuffle_seed",
        "5",
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(RESUME_AT),
        "--training.steps",
        str(STEPS),
    ]


def train(nproc: int, folder: Path, args: list[str]) -> list[dict]:
    run_torchrun(nproc, train_args(nproc, folder, args), timeout=300)
    return {r["step"]: r for r in read_metrics(folder)}


def test_a_store_run_resumes_exactly_and_reshards(store_args, tmp_path):
    straight = train(2, tmp_path / "straight", store_args)
    stopped = tmp_path / "stopped"
    first = train(2, stopped, [*store_args, "--debug.stop_after_step", str(RESUME_AT)])
    assert sorted(first) == list(range(1, RESUME_AT + 1))
    wider = tmp_path / "fsdp4"
    shutil.copytree(stopped / "checkpoint", wider / "checkpoint")
    resumed = train(2, stopped, store_args)
    for step in range(RESUME_AT + 1, STEPS + 1):
        a, b = straight[step], resumed[step]
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), step
    resharded = train(4, wider, store_args)
    for step in range(RESUME_AT + 1, STEPS + 1):
        for key in ("loss", "grad_norm"):
            assert math.isclose(straight[step][key], resharded[step][key], rel_tol=RTOL), (
                step,
                key,
            )
    assert straight[STEPS]["loss"] < straight[1]["loss"] - 0.5
