"""scripts/loss_compare.py on hand-written metrics.jsonl files (no training): the default
tolerance, --rtol, --plot and one-line errors for bad dump folders."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "loss_compare.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = (1, 2, 3)


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("loss_compare_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


loss_compare = _load_script()


def _dump(folder: Path, relative_error: float = 0.0) -> Path:
    """A dump folder whose loss at step 2 is off by ``relative_error``."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step in STEPS:
            loss = (3.0 - 0.25 * step) * (1 + (relative_error if step == 2 else 0.0))
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": 1.0 / step}) + "\n")
    return folder


def _compare(tmp_path: Path, relative_error: float, *options: str) -> int:
    baseline, test = _dump(tmp_path / "a"), _dump(tmp_path / "b", relative_error)
    return loss_compare.main(["--baseline-dump", str(baseline), "--test-dump", str(test), *options])


def test_default_rtol_accepts_float32_rounding(tmp_path, capsys) -> None:
    assert _compare(tmp_path, 1e-6, "--assert-equal") == 0
    assert "runs equal (rtol 0.0001)" in capsys.readouterr().out


def test_default_rtol_rejects_a_planted_error(tmp_path, capsys) -> None:
    assert _compare(tmp_path, 1e-3, "--assert-equal") == 1
    out = capsys.readouterr().out
    assert "MISMATCH step 2: loss" in out
    assert "runs differ (rtol 0.0001)" in out


def test_rtol_zero_is_bitwise(tmp_path, capsys) -> None:
    assert _compare(tmp_path, 1e-6, "--assert-equal", "--rtol", "0") == 1
    assert "runs differ (rtol 0)" in capsys.readouterr().out


def test_plot_writes_a_png(tmp_path, capsys) -> None:
    out = tmp_path / "compare.png"
    assert _compare(tmp_path, 1e-3, "--plot", str(out)) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert f"plot: {out}" in capsys.readouterr().out


def test_plot_has_a_loss_and_a_grad_norm_panel(tmp_path) -> None:
    baseline = loss_compare.read_metrics(_dump(tmp_path / "a"))
    test = loss_compare.read_metrics(_dump(tmp_path / "b", 1e-3))
    figure = loss_compare.plot_comparison(baseline, test, 1e-4)
    loss_ax, grad_norm_ax = figure.axes
    assert (loss_ax.get_ylabel(), grad_norm_ax.get_ylabel()) == ("loss", "grad_norm")
    labels = [line.get_label() for line in loss_ax.get_lines()]
    assert labels == ["baseline", "test", "test outside the band"]
    assert len(loss_ax.collections) == 1  # the shaded band
    assert "1 of 3" in loss_ax.get_title() and "0 of 3" in grad_norm_ax.get_title()


def test_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _compare(tmp_path, 0.0, "--plot", str(tmp_path / "x.png")) == 2
    err = capsys.readouterr().err
    assert err == "error: --plot needs matplotlib: pip install -e '.[plot]'\n"
    assert not (tmp_path / "x.png").exists()


def test_missing_dump_folder_is_one_line(tmp_path) -> None:
    missing = tmp_path / "nowhere"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--baseline-dump", str(missing), "--test-dump", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == f"error: dump folder {missing}: no such folder\n"
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no metrics.jsonl in it"),
        ("{not json\n", "metrics.jsonl is not JSON lines"),
        ('{"step": 1}\n', "a metrics.jsonl record lacks one of step, loss, grad_norm"),
    ],
)
def test_bad_dump_folder_is_one_line(tmp_path, capsys, content, message) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    if content is not None:
        (bad / "metrics.jsonl").write_text(content)
    good = _dump(tmp_path / "good")
    assert loss_compare.main(["--baseline-dump", str(good), "--test-dump", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: dump folder {bad}: {message}") and err.count("\n") == 1
