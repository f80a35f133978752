"""README.md's tables say what the code does: the Models table lists exactly the flavors each
built-in model registers (a new flavor without its README entry fails here), and the memory
table of the ready configs holds the GPU count each config states and the closed-form peak
per GPU that ``scripts/estimate/estimation.py --memory_estimation.mode analytic`` prints."""

from __future__ import annotations

import re

import pytest

from tests.launcher import REPO_ROOT
from torchtitan.config import ConfigManager
from torchtitan.estimate import report
from torchtitan.estimate.cli import analytic_fit
from torchtitan.models import BUILTIN_MODELS
from torchtitan.protocols import get_train_spec

README = REPO_ROOT / "README.md"
CONFIG_DIR = REPO_ROOT / "train_configs"
READY_CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.toml") if "debug" not in p.name)


def section(title: str) -> str:
    """The text of README's ``## title`` section, up to the next ``## `` heading."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match is not None, f"README.md has no '## {title}' section"
    return match[1]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row whose first cell is code, backticks removed."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| `"):
            rows.append([cell.strip().replace("`", "") for cell in line.strip("|").split("|")])
    return rows


def readme_flavors() -> dict[str, list[str]]:
    return {
        spec: [flavor.strip() for flavor in flavors.split(",")]
        for spec, flavors in table_rows(section("Models"))
    }


def memory_table() -> dict[str, tuple[int, str]]:
    """config file name -> (GPUs, closed-form peak per GPU) from README's memory table."""
    return {row[0]: (int(row[1]), row[3]) for row in table_rows(section("Memory planning"))}


def test_models_table_lists_every_builtin_model():
    assert sorted(readme_flavors()) == sorted(BUILTIN_MODELS)


@pytest.mark.parametrize("spec", BUILTIN_MODELS)
def test_models_table_lists_exactly_the_registered_flavors(spec: str):
    registered = list(get_train_spec(spec).model_args)
    assert readme_flavors()[spec] == registered, (
        f"README.md's Models row for {spec} must list {', '.join(registered)}"
    )


def test_memory_table_lists_every_ready_config():
    assert sorted(memory_table()) == READY_CONFIGS


@pytest.mark.parametrize("name", READY_CONFIGS)
def test_memory_table_row_is_what_the_estimator_prints(name: str):
    config = ConfigManager().parse_args(["--job.config_file", str(CONFIG_DIR / name)])
    peak = report.size(analytic_fit(config).peak.peak_bytes)
    assert memory_table()[name] == (config.memory_estimation.world_size, peak), (
        f"README.md's memory table row for {name}: "
        f"{config.memory_estimation.world_size} GPUs, {peak}"
    )
