"""scripts/generate/test_generate.py on a checkpoint the trainer wrote: the KV cache gives
the no-cache samples, and tensor parallel (torchrun, 2 ranks) gives the 1-process samples."""

import json
import subprocess
import sys

import pytest

from tests.launcher import REPO_ROOT, run_torchrun
from tests.parity import BASE_OVERRIDES
from tests.unit_tests.test_generation import DEBUG_TOML, SCRIPT, TINY, load_cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory):
    """The tiny model trained 10 steps (fp32), saved by the CheckpointManager at the end."""
    dump = tmp_path_factory.mktemp("generation_run")
    run_torchrun(
        1,
        [
            *BASE_OVERRIDES,
            "--job.dump_folder",
            str(dump),
            "--training.local_batch_size",
            "8",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "10",
        ],
    )
    return dump / "checkpoint"


def _cli_args(checkpoint, out, *extra: str) -> list[str]:
    return [
        "--config",
        str(DEBUG_TOML),
        "--checkpoint",
        str(checkpoint),
        "--model.flavor",
        TINY,
        "--prompt",
        "import os\n",
        "--max_new_tokens",
        str(NEW_TOKENS),
        "--seed",
        "3",
        "--temperature",
        "0.7",
        "--top_k",
        "50",
        "--batch_size",
        "2",
        "--out",
        str(out),
        *extra,
    ]


def _samples(path) -> list[dict]:
    return json.loads(path.read_text())["samples"]


def test_generates_from_the_trainers_checkpoint(checkpoint_root, tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *_cli_args(checkpoint_root, tmp_path / "cached.json")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--- sample 0" in result.stdout and "--- sample 1" in result.stdout
    cached = json.loads((tmp_path / "cached.json").read_text())
    assert cached["checkpoint"].endswith("step-10") and cached["kv_cache"]
    assert all(0 < len(s["tokens"]) <= NEW_TOKENS and s["text"] for s in cached["samples"])

    load_cli().main(_cli_args(checkpoint_root, tmp_path / "uncached.json", "--no_kv_cache"))
    assert _samples(tmp_path / "uncached.json") == cached["samples"]


def test_tensor_parallel_samples_equal_one_process(checkpoint_root, tmp_path) -> None:
    run_torchrun(2, _cli_args(checkpoint_root, tmp_path / "tp.json"), module=None, script=SCRIPT)
    load_cli().main(_cli_args(checkpoint_root, tmp_path / "one.json"))
    assert _samples(tmp_path / "tp.json") == _samples(tmp_path / "one.json")
