"""Every ready (non-debug) config in train_configs/ fits the GPUs it states.

Each config states its GPU count and memory once, in ``[memory_estimation]`` (world_size,
device_memory_gib); its header comment must say the same ("N GPUs of M GB"). The check is
the estimator's closed form (``--memory_estimation.mode analytic``) at that world size:
the trainer's preflight accepts the layout, and the verdict must be "fits" ("tight" means
the allocator's reserve and NCCL buffers do not fit, which a ready config must not ask users
to live with). The closed form, not the fake-tensor trace, because tracing 405B or 671B on
fake tensors takes minutes to hours; the closed form is checked against traces in
test_memory_estimation.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT
from torchtitan.config import ConfigManager, JobConfig
from torchtitan.estimate.cli import analytic_fit

CONFIG_DIR = REPO_ROOT / "train_configs"
READY = sorted(p for p in CONFIG_DIR.glob("*.toml") if "debug" not in p.name)
EXPECTED = {
    "llama3_8b",
    "llama3_8b_lora",
    "llama3_70b",
    "llama3_70b_qlora",
    "llama3_405b",
    "qwen3_8b",
    "qwen3_30b_a3b",
    "deepseek_v3_16b",
    "deepseek_v3_671b",
}


def _parse(path: Path, *overrides: str) -> JobConfig:
    return ConfigManager().parse_args(["--job.config_file", str(path), *overrides])


def _header(path: Path) -> str:
    """The leading comment block, joined into one line."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    return " ".join(lines)


def test_the_ready_configs_are_all_there():
    assert EXPECTED <= {p.stem for p in READY}


@pytest.mark.parametrize("path", READY, ids=lambda p: p.stem)
def test_ready_config_fits_the_gpus_it_states(path: Path):
    config = _parse(path)
    me = config.memory_estimation
    assert me.world_size is not None and me.device_memory_gib is not None, (
        f"{path.name}: state [memory_estimation] world_size and device_memory_gib"
    )
    stated = re.search(r"(\d+) GPUs? of (\d+) GB", _header(path))
    assert stated is not None, (
        f"{path.name}: the header must say 'N GPUs of M GB' (or '1 GPU of M GB')"
    )
    assert (int(stated[1]), float(stated[2])) == (me.world_size, me.device_memory_gib)
    fit = analytic_fit(config)
    assert fit.parallel_dims.world_size == me.world_size
    assert fit.verdict.startswith("verdict: fits in"), f"{path.name}: {fit.verdict}"


def test_405b_on_one_node_does_not_fit():
    """The planted error: the same check says so when a layout cannot fit."""
    config = _parse(
        CONFIG_DIR / "llama3_405b.toml",
        "--memory_estimation.world_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "1",
    )
    assert analytic_fit(config).verdict.startswith("verdict: does NOT fit in 80 GiB")


def test_a_large_batch_is_only_tight():
    """Allocations that fit but leave no room for the allocator's reserve are refused too
    (Llama 3 8B without AC on the full logits; the chunked loss leaves room)."""
    config = _parse(
        CONFIG_DIR / "llama3_8b.toml",
        "--activation_checkpoint.mode",
        "none",
        "--training.loss_chunk_size",
        "0",
    )
    assert analytic_fit(config).verdict.startswith("verdict: tight in 80 GiB")


DEBUG = sorted(p for p in CONFIG_DIR.glob("*.toml") if "debug" in p.name)


def test_every_config_file_is_checked_here():
    assert set(READY) | set(DEBUG) == set(CONFIG_DIR.glob("*.toml")) and len(DEBUG) >= 5


@pytest.mark.parametrize("path", DEBUG, ids=lambda p: p.stem)
def test_debug_config_passes_every_pre_launch_check_on_this_machine(path: Path, monkeypatch):
    """What run_train.sh checks before it starts a rank: the merged config, the layout on
    one process, the data set, the tokenizer, the converters and the device features."""
    from torchtitan.preflight import check_inputs, preflight

    monkeypatch.chdir(REPO_ROOT)  # data paths in the configs are relative to the repository
    config = _parse(path)
    preflight(config, 1, "cpu")
    check_inputs(config, "cpu")
