"""Compare the per-step loss and grad norm of two training runs.

Compare two finished runs (their ``{dump_folder}/metrics.jsonl``):

    python scripts/loss_compare.py --baseline-dump outputs/a --test-dump outputs/b

Or train both first, with the same seed and deterministic algorithms, from two configs,
two sets of options and/or two commits (each commit runs from its own ``git worktree``):

    python scripts/loss_compare.py --config train_configs/debug_model.toml --steps 20 \\
        --test-options "--optimizer.lr 1e-3" [--baseline-commit main --test-commit HEAD] \\
        [--nproc 2] [--assert-equal [--rtol 1e-6]]

Prints a side-by-side table and the largest differences. With ``--assert-equal`` the exit
code is 1 unless every step of both runs matches within ``--rtol`` (default 0: bitwise).
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

REPO_ROOT = Path(__file__).resolve().parents[1]
KEYS = ("loss", "grad_norm")


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
    path = Path(dump_folder) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist (was the run's job.dump_folder {dump_folder}?)"
        )
    with open(path) as f:
        return {record["step"]: record for record in map(json.loads, filter(str.strip, f))}


def differences(baseline: dict[int, dict], test: dict[int, dict]) -> list[Difference]:
    """Every (key, step) logged by both runs, in step order."""
    return [
        Difference(key, step, baseline[step][key], test[step][key])
        for step in sorted(baseline.keys() & test.keys())
        for key in KEYS
    ]


def mismatches(baseline: dict[int, dict], test: dict[int, dict], rtol: float) -> list[str]:
    problems = []
    if baseline.keys() != test.keys():
        problems.append(f"logged steps differ: baseline {sorted(baseline)}, test {sorted(test)}")
    for d in differences(baseline, test):
        if not math.isclose(d.baseline, d.test, rel_tol=rtol, abs_tol=0.0):
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
        "--rtol", type=float, default=0.0, help="relative tolerance of --assert-equal"
    )
    args = parser.parse_args(argv)
    compare_dumps = args.baseline_dump is not None or args.test_dump is not None
    if compare_dumps and (args.baseline_dump is None or args.test_dump is None):
        parser.error("--baseline-dump and --test-dump go together")
    if not compare_dumps and not (args.config or (args.baseline_config and args.test_config)):
        parser.error(
            "give --baseline-dump/--test-dump, or --config (or --baseline-config and --test-config)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.baseline_dump is not None:
        baseline_folder, test_folder = args.baseline_dump, args.test_dump
    else:
        baseline_folder, test_folder = run_both(args)
    baseline, test = read_metrics(baseline_folder), read_metrics(test_folder)
    print(f"baseline: {baseline_folder}\ntest:     {test_folder}")
    print(format_table(baseline, test))
    if not args.assert_equal:
        return 0
    problems = mismatches(baseline, test, args.rtol)
    for problem in problems:
        print(f"MISMATCH {problem}")
    print("runs differ" if problems else f"runs equal (rtol {args.rtol:g})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
