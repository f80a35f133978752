"""Compare the per-step loss and grad norm of two training runs.

Compare two finished runs (their ``{dump_folder}/metrics.jsonl``):

    python scripts/loss_compare.py --baseline-dump outputs/a --test-dump outputs/b

Or train both first, with the same seed and deterministic algorithms, from two configs,
two sets of options and/or two commits (each commit runs from its own ``git worktree``):

    python scripts/loss_compare.py --config train_configs/debug_model.toml --steps 20 \\
        --test-options "--optimizer.lr 1e-3" [--baseline-commit main --test-commit HEAD] \\
        [--nproc 2] [--assert-equal [--rtol 1e-4]] [--plot out.png]

Prints a side-by-side table and the largest differences. With ``--assert-equal`` the exit
code is 1 unless every step of both runs matches within ``--rtol``: relative tolerance,
default 1e-4 (the parity harness's), ``--rtol 0`` for bitwise. ``--plot out.png`` draws loss
and grad norm per step of both runs with the band baseline x (1 +/- rtol) shaded and the test
steps outside it marked (needs matplotlib: ``pip install -e '.[plot]'``). A missing dump
folder or metrics.jsonl exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

REPO_ROOT = Path(__file__).resolve().parents[1]
KEYS = ("loss", "grad_norm")
PARITY_RTOL = 1e-4
"""Default relative tolerance: the parity harness's (RTOL in tests/parity.py), so layouts that
agree to float32 rounding compare equal."""
PLOT_HINT = "--plot needs matplotlib: pip install -e '.[plot]'"


class InputError(Exception):
    """A problem with the inputs the user fixes (missing dump folder, no matplotlib):
    reported as one line, exit code 2."""


@dataclass
class Difference:
    key: str
    step: int
    baseline: float
    test: float

    @property
    def absolute(self) -> float:
        return abs(self.baseline - self.test)

    @property
    def relative(self) -> float:
        if self.baseline == 0:
            return 0.0 if self.absolute == 0 else math.inf
        return self.absolute / abs(self.baseline)


def read_metrics(dump_folder: Path) -> dict[int, dict[str, float]]:
    folder = Path(dump_folder)
    path = folder / "metrics.jsonl"
    if not folder.is_dir():
        problem = "not a folder" if folder.exists() else "no such folder"
        raise InputError(f"dump folder {folder}: {problem}")
    if not path.is_file():
        raise InputError(
            f"dump folder {folder}: no metrics.jsonl in it (was it the run's job.dump_folder?)"
        )
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise InputError(f"dump folder {folder}: cannot read metrics.jsonl ({e.strerror})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"dump folder {folder}: metrics.jsonl is not JSON lines ({e})") from e
    required = ("step", *KEYS)
    if not all(isinstance(r, dict) and all(k in r for k in required) for r in records):
        raise InputError(
            f"dump folder {folder}: a metrics.jsonl record lacks one of {', '.join(required)}"
        )
    return {record["step"]: record for record in records}


def differences(baseline: dict[int, dict], test: dict[int, dict]) -> list[Difference]:
    """Every (key, step) logged by both runs, in step order."""
    return [
        Difference(key, step, baseline[step][key], test[step][key])
        for step in sorted(baseline.keys() & test.keys())
        for key in KEYS
    ]


def within(d: Difference, rtol: float) -> bool:
    return math.isclose(d.baseline, d.test, rel_tol=rtol, abs_tol=0.0)


def mismatches(baseline: dict[int, dict], test: dict[int, dict], rtol: float) -> list[str]:
    problems = []
    if baseline.keys() != test.keys():
        problems.append(f"logged steps differ: baseline {sorted(baseline)}, test {sorted(test)}")
    for d in differences(baseline, test):
        if not within(d, rtol):
            problems.append(
                f"step {d.step}: {d.key} {d.test!r} vs baseline {d.baseline!r} "
                f"(relative difference {d.relative:.3e} > rtol {rtol:g})"
            )
    return problems


def format_table(baseline: dict[int, dict], test: dict[int, dict]) -> str:
    header = (
        f"{'step':>6}  {'loss (base)':>13}  {'loss (test)':>13}  {'|diff|':>10}  "
        f"{'grad_norm (base)':>17}  {'grad_norm (test)':>17}  {'|diff|':>10}"
    )
    rows = [header, "-" * len(header)]
    diffs = differences(baseline, test)
    for loss, grad_norm in zip(diffs[0::2], diffs[1::2]):
        rows.append(
            f"{loss.step:>6}  {loss.baseline:>13.6f}  {loss.test:>13.6f}  {loss.absolute:>10.3e}  "
            f"{grad_norm.baseline:>17.6f}  {grad_norm.test:>17.6f}  {grad_norm.absolute:>10.3e}"
        )
    for key in KEYS:
        largest = max((d for d in diffs if d.key == key), key=lambda d: d.absolute, default=None)
        if largest is not None:
            rows.append(
                f"largest {key} difference: {largest.absolute:.3e} "
                f"(relative {largest.relative:.3e}) at step {largest.step}"
            )
    return "\n".join(rows)


def require_matplotlib() -> None:
    """Fail before any training when --plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError(PLOT_HINT) from None


def plot_comparison(
    baseline: dict[int, dict],
    test: dict[int, dict],
    rtol: float,
    labels: tuple[str, str] = ("baseline", "test"),
) -> Figure:
    """Two panels (loss, grad norm per step): both runs, the band baseline x (1 +/- rtol)
    shaded, and test steps outside it marked (at rtol 1e-4 the band is thinner than a line)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(9, 7), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(KEYS), 1, sharex=True)
    for ax, key in zip(axes, KEYS):
        _plot_metric(ax, key, baseline, test, rtol, labels)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(f"{labels[1]}  vs  {labels[0]}  (band: baseline x (1 ± {rtol:g}))")
    return figure


def _plot_metric(
    ax: Axes,
    key: str,
    baseline: dict[int, dict],
    test: dict[int, dict],
    rtol: float,
    labels: tuple[str, str],
) -> None:
    steps = sorted(baseline)
    values = [baseline[s][key] for s in steps]
    ax.fill_between(
        steps,
        [v * (1 - rtol) for v in values],
        [v * (1 + rtol) for v in values],
        color="C0",
        alpha=0.25,
        label=f"tolerance band (rtol {rtol:g})",
    )
    ax.plot(steps, values, "o-", color="C0", markersize=3, label=labels[0])
    test_steps = sorted(test)
    ax.plot(
        test_steps,
        [test[s][key] for s in test_steps],
        "s--",
        color="C1",
        markersize=3,
        label=labels[1],
    )
    compared = [d for d in differences(baseline, test) if d.key == key]
    outside = [d for d in compared if not within(d, rtol)]
    if outside:
        ax.plot(
            [d.step for d in outside],
            [d.test for d in outside],
            "x",
            color="red",
            markersize=8,
            markeredgewidth=2,
            label="test outside the band",
        )
    ax.set_title(f"{key}: {len(outside)} of {len(compared)} common steps outside the band")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend()


def save_plot(figure: Figure, path: Path) -> None:
    try:
        figure.savefig(path, dpi=120)
    except OSError as e:
        raise InputError(f"--plot {path}: cannot write it ({e.strerror})") from None


@contextmanager
def source_tree(commit: str | None) -> Iterator[Path]:
    """The repository at ``commit`` (a temporary ``git worktree``), or this tree if None."""
    if commit is None:
        yield REPO_ROOT
        return
    folder = Path(tempfile.mkdtemp(prefix="loss_compare_"))
    subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(folder), commit],
        check=True,
        capture_output=True,
        text=True,
    )
    try:
        yield folder
    finally:
        subprocess.run(
            ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(folder)],
            check=True,
            capture_output=True,
            text=True,
        )


def train(
    tree: Path, config: str, options: list[str], dump_folder: Path, args: argparse.Namespace
) -> None:
    """One deterministic run of ``torchtitan.train`` from ``tree`` (config paths are
    relative to that tree), logging every step to ``dump_folder``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "-m",
        "torchtitan.train",
        "--job.config_file",
        config,
        "--job.dump_folder",
        str(dump_folder.resolve()),
        "--training.steps",
        str(args.steps),
        "--metrics.log_freq",
        "1",
        "--debug.seed",
        str(args.seed),
        "--debug.deterministic",
        *options,
    ]
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    print(f"$ (cd {tree} && {shlex.join(cmd)})", flush=True)
    result = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"training run failed (exit {result.returncode}):\n"
            f"{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )


def run_both(args: argparse.Namespace) -> tuple[Path, Path]:
    output = Path(args.output_dir or tempfile.mkdtemp(prefix="loss_compare_runs_"))
    shared = shlex.split(args.options)
    folders = []
    for label in ("baseline", "test"):
        config = getattr(args, f"{label}_config") or args.config
        commit = getattr(args, f"{label}_commit")
        options = shared + shlex.split(getattr(args, f"{label}_options"))
        folder = output / label
        with source_tree(commit) as tree:
            train(tree, config, options, folder, args)
        folders.append(folder)
    return folders[0], folders[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--baseline-dump", type=Path, help="compare this finished run's dump folder ..."
    )
    parser.add_argument("--test-dump", type=Path, help="... with this one (no training)")
    parser.add_argument("--config", help="job config of both runs (relative to each run's tree)")
    parser.add_argument(
        "--baseline-config", help="job config of the baseline run (default --config)"
    )
    parser.add_argument("--test-config", help="job config of the test run (default --config)")
    parser.add_argument("--options", default="", help="trainer options of both runs")
    parser.add_argument(
        "--baseline-options", default="", help="extra trainer options of the baseline run"
    )
    parser.add_argument("--test-options", default="", help="extra trainer options of the test run")
    parser.add_argument(
        "--baseline-commit", help="train the baseline from this commit (git worktree)"
    )
    parser.add_argument("--test-commit", help="train the test run from this commit (git worktree)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output-dir", help="dump folders go to <dir>/baseline and <dir>/test")
    parser.add_argument(
        "--assert-equal", action="store_true", help="exit 1 on any difference beyond --rtol"
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=PARITY_RTOL,
        help=f"relative tolerance of --assert-equal and the --plot band (default {PARITY_RTOL:g}, "
        "the parity harness's; 0: bitwise)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="draw loss and grad norm per step of both runs with the tolerance band",
    )
    args = parser.parse_args(argv)
    if args.rtol < 0:
        parser.error("--rtol must be >= 0")
    compare_dumps = args.baseline_dump is not None or args.test_dump is not None
    if compare_dumps and (args.baseline_dump is None or args.test_dump is None):
        parser.error("--baseline-dump and --test-dump go together")
    if not compare_dumps and not (args.config or (args.baseline_config and args.test_config)):
        parser.error(
            "give --baseline-dump/--test-dump, or --config (or --baseline-config and --test-config)"
        )
    return args


def compare(args: argparse.Namespace) -> int:
    if args.plot is not None:
        require_matplotlib()
    if args.baseline_dump is not None:
        baseline_folder, test_folder = args.baseline_dump, args.test_dump
    else:
        baseline_folder, test_folder = run_both(args)
    baseline, test = read_metrics(baseline_folder), read_metrics(test_folder)
    print(f"baseline: {baseline_folder}\ntest:     {test_folder}")
    print(format_table(baseline, test))
    if args.plot is not None:
        labels = (f"baseline: {baseline_folder}", f"test: {test_folder}")
        save_plot(plot_comparison(baseline, test, args.rtol, labels), args.plot)
        print(f"plot: {args.plot}")
    if not args.assert_equal:
        return 0
    problems = mismatches(baseline, test, args.rtol)
    for problem in problems:
        print(f"MISMATCH {problem}")
    print(f"runs {'differ' if problems else 'equal'} (rtol {args.rtol:g})")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return compare(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
