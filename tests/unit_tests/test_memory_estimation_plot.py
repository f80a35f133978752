"""--memory_estimation.plot: the traced step's per-phase breakdown as a stacked bar chart."""

from __future__ import annotations

import sys

import pytest

from tests.launcher import REPO_ROOT
from torchtitan.config import ConfigManager
from torchtitan.estimate import cli, plot, report
from torchtitan.estimate.build import TrainingBuild
from torchtitan.estimate.cli import main
from torchtitan.estimate.trace import TraceOutcome, trace_training_memory

TINY = [
    "--job.config_file",
    str(REPO_ROOT / "train_configs" / "debug_model.toml"),
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--memory_estimation.world_size",
    "2",
]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def outcome() -> TraceOutcome:
    return trace_training_memory(TrainingBuild(ConfigManager().parse_args(TINY), 2, "cuda"))


@pytest.fixture
def traced(outcome):
    return outcome.result


def test_peak_phase_stacks_sum_to_the_traced_peak(traced) -> None:
    phases, stacks = plot.phase_stacks(traced)
    assert phases == ["forward", "loss", "backward", "clip_grad_norm", "optimizer_step"]
    assert list(stacks) == list(report.heading_totals({}))
    peak = phases.index(traced.place.phase)
    assert sum(nbytes[peak] for nbytes in stacks.values()) == traced.peak_bytes
    for i, phase in enumerate(phases):  # every bar is its phase's peak
        total = sum(nbytes[i] for nbytes in stacks.values())
        assert total == traced.phase_peaks[traced.place.iteration, phase]


def test_figure_has_one_stacked_bar_per_phase(traced) -> None:
    ax = plot.plot_breakdown(traced, "title").axes[0]
    phases = report.step_phases(traced)
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == phases
    assert len(ax.containers) == len(report.heading_totals({}))
    assert all(len(bars) == len(phases) for bars in ax.containers)
    peak = phases.index(traced.place.phase)
    unit = report.unit_for(traced.peak_bytes)[1]
    stacked = sum(bars.patches[peak].get_height() for bars in ax.containers)
    assert stacked == pytest.approx(traced.peak_bytes / unit, rel=1e-9)
    assert ax.get_title() == "title"


def test_cli_writes_the_png(outcome, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "trace_training_memory", lambda *args: outcome)  # traced once
    out = tmp_path / "mem.png"
    assert main(TINY + ["--memory_estimation.plot", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert capsys.readouterr().out.endswith(f"plot: {out}\n")


def _one_line_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    return err


def test_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    err = _one_line_error(TINY + ["--memory_estimation.plot", str(tmp_path / "m.png")], capsys)
    assert err == "error: --memory_estimation.plot needs matplotlib: pip install -e '.[plot]'\n"


def test_other_modes_refuse_the_plot(tmp_path, capsys) -> None:
    argv = TINY + ["--memory_estimation.plot", str(tmp_path / "m.png")]
    err = _one_line_error(argv + ["--memory_estimation.mode", "plan"], capsys)
    assert "memory_estimation.plot: only mode estimate draws it" in err
    err = _one_line_error(argv + ["--memory_estimation.disable_fake_mode"], capsys)
    assert "not with memory_estimation.disable_fake_mode" in err
