"""README.md's tables say what the code does: the Models table lists exactly the flavors each
built-in model registers (a new flavor without its README entry fails here), and the memory
table of the ready configs holds the GPU count each config states, the closed-form peak
per GPU that ``scripts/estimate/estimation.py --memory_estimation.mode analytic`` prints on
both loss paths, and the largest local batch and sequence that still fit on each."""

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


def memory_table() -> dict[str, list[str]]:
    """config file name -> its row of README's memory table (GPUs, layout, closed-form peak
    per GPU, the peak on the full logits, what fits on the chunked loss / the full logits)."""
    return {row[0]: row[1:] for row in table_rows(section("Memory planning"))}


# the largest value that fits is a multiple of these steps
AFFORD_STEPS = {"local_batch_size": 1, "seq_len": 1024}


def fits(name: str, chunk: str, knob: str = "local_batch_size", value: int | None = None) -> bool:
    args = ["--job.config_file", str(CONFIG_DIR / name), "--training.loss_chunk_size", chunk]
    if value is not None:
        args += [f"--training.{knob}", str(value)]
    return analytic_fit(ConfigManager().parse_args(args)).verdict.startswith("verdict: fits")


def affordable(name: str, chunk: str) -> str:
    """README's cell: the largest local batch (at the config's seq) and the largest seq (at
    its local batch) that the closed form still says fit, found by doubling and bisection."""
    config = ConfigManager().parse_args(["--job.config_file", str(CONFIG_DIR / name)])
    found = {}
    for knob, step in AFFORD_STEPS.items():
        low = getattr(config.training, knob) // step  # fits (the ready configs do)
        high = 2 * low
        while fits(name, chunk, knob, high * step):
            low, high = high, 2 * high
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(name, chunk, knob, mid * step) else (low, mid)
        found[knob] = low * step
    return f"batch {found['local_batch_size']}, seq {found['seq_len']}"


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
    row = memory_table()[name]
    peaks = []
    for chunk in ("-1", "0"):
        args = ["--job.config_file", str(CONFIG_DIR / name), "--training.loss_chunk_size", chunk]
        config = ConfigManager().parse_args(args)
        peaks.append(report.size(analytic_fit(config).peak.peak_bytes))
    expected = [str(config.memory_estimation.world_size), peaks[0], peaks[1]]
    assert [row[0], row[2], row[3]] == expected, (
        f"README.md's memory table row for {name}: GPUs, peak, full-logits peak = {expected}"
    )


@pytest.mark.parametrize("name", READY_CONFIGS)
def test_memory_table_says_what_each_config_can_afford(name: str):
    """Each stated maximum fits and one step more does not (cheap: 8 closed forms)."""
    cells = memory_table()[name][4:6]
    for chunk, cell in zip(("-1", "0"), cells):
        values = dict(zip(AFFORD_STEPS, map(int, re.findall(r"\d+", cell))))
        assert len(values) == 2, f"README.md, {name}: '{cell}' is not 'batch B, seq S'"
        for knob, step in AFFORD_STEPS.items():
            assert fits(name, chunk, knob, values[knob]), (name, chunk, knob, values[knob])
            assert not fits(name, chunk, knob, values[knob] + step), (
                f"README.md, {name}: {knob} {values[knob] + step} still fits "
                f"(loss_chunk_size {chunk}): the cell should say {affordable(name, chunk)}"
            )
