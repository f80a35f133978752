"""Chunked linear cross-entropy vs the full logits: peak memory, tokens/s and the estimator.

    python scripts/bench/chunked_loss.py --output benchmarks/chunked_loss_cpu.md
    python scripts/bench/chunked_loss.py --part estimator      # the estimator table alone

Part ``trainer``: each case trains twice on one process (``torchrun -m torchtitan.train``,
2 threads, fp32), once with ``--training.loss_chunk_size 0`` (the full logits) and once
with the default (-1, auto chunks), and reports the peak RSS (the trainer's
``memory_gib`` on CPU), tokens/s (median of the steps after the first two) and the losses
of both runs. Cases: the Llama 3 debug model with a 128k vocabulary and a model of Llama 3
1B's dimensions with one block (``scripts/bench/extra_flavors.py``), each at seq 2048 and
8192, tokenized by ``padded_tokenizer.py`` (vocabulary 128,256). A run whose traced peak
(the estimator, mode estimate) exceeds ``--memory-limit-gib`` is not started; the table
gives the trace instead.

Part ``preset``: the upstream comparison workload (``benchmark.py --preset upstream-debug``,
vocabulary 2,000, bf16 autocast) for 12 steps on both paths: tokens/s, peak RSS, losses.

Part ``estimator``: the per-GPU peak of Llama 3 8B (FSDP 8, seq 8192, its ready config) and
70B (its ready config, FSDP 8 x TP 8) on both loss paths, traced on fake tensors (mode
estimate, target cuda) beside the closed form.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from scripts.bench.benchmark import UPSTREAM_DEBUG, _git, machine, preset_overrides  # noqa: E402
from scripts.bench.padded_tokenizer import write_padded_tokenizer  # noqa: E402

WARMUP_STEPS = 2
PATHS = {"full logits": "0", "chunked": "-1"}


@dataclass(frozen=True)
class Case:
    name: str
    flavor: str
    seq_len: int
    steps: int


CASES = [
    Case("debug model, 128k vocabulary", "debugmodel_128k", 2048, 8),
    Case("debug model, 128k vocabulary", "debugmodel_128k", 8192, 5),
    Case("1B dimensions, 1 block", "1B_1layer", 2048, 4),
    Case("1B dimensions, 1 block", "1B_1layer", 8192, 3),
]
ESTIMATOR_CONFIGS = [
    ("Llama 3 8B, FSDP 8, seq 8192, AC every 2nd block", "train_configs/llama3_8b.toml"),
    ("Llama 3 70B, FSDP 8 x TP 8, seq 8192, full AC", "train_configs/llama3_70b.toml"),
]


def _run(cmd: list[str], threads: int = 2) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"exit {result.returncode}: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def _case_flags(case: Case, chunk: str, tokenizer: Path) -> list[str]:
    return [
        "--model.tokenizer_path",
        str(tokenizer),
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--experimental.custom_import",
        "scripts.bench.extra_flavors",
        "--model.flavor",
        case.flavor,
        "--training.seq_len",
        str(case.seq_len),
        "--training.local_batch_size",
        "1",
        "--training.mixed_precision_param",
        "float32",
        "--training.loss_chunk_size",
        chunk,
    ]


def traced_peak_gib(flags: list[str], target: str, extra: list[str] = ()) -> tuple[float, float]:
    """(traced peak, closed-form peak) in GiB of mode estimate for these trainer flags."""
    out = _run(
        [
            sys.executable,
            "scripts/estimate/estimation.py",
            *flags,
            "--memory_estimation.target_device",
            target,
            *extra,
        ]
    )
    traced = (
        int(
            re.search(r"traced allocated peak per rank: .*?\(([\d,]+) B\)", out)
            .group(1)
            .replace(",", "")
        )
        / 2**30
    )
    diff = float(re.search(r"analytic estimate: .*?\(([+-][\d.]+)% vs traced", out).group(1))
    return traced, traced * (1 + diff / 100)


def train(flags: list[str], steps: int, folder: Path) -> dict:
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "-m",
            "torchtitan.train",
            *flags,
            "--training.steps",
            str(steps),
            "--metrics.log_freq",
            "1",
            "--job.dump_folder",
            str(folder),
        ]
    )
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl") if line.strip()]
    return {
        "memory_gib": max(r["memory_gib"] for r in rows),
        "tps": statistics.median(r["tps"] for r in rows if r["step"] > WARMUP_STEPS),
        "losses": [r["loss"] for r in rows],
    }


def trainer_part(memory_limit_gib: float, tokenizer: Path) -> list[str]:
    lines = [
        "| model | seq | path | peak RSS | traced peak (cpu) | tokens/s | losses (first -> last) |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for case in CASES:
        for path, chunk in PATHS.items():
            flags = _case_flags(case, chunk, tokenizer)
            traced, _ = traced_peak_gib(flags, "cpu", ["--memory_estimation.world_size", "1"])
            if traced > memory_limit_gib:
                result = f"| not run (> {memory_limit_gib:g} GiB) | {traced:.2f} GiB | - | - |"
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    r = train(flags, case.steps, Path(tmp))
                losses = f"{r['losses'][0]:.5f} -> {r['losses'][-1]:.5f}"
                result = (
                    f"| {r['memory_gib']:.2f} GiB | {traced:.2f} GiB | {r['tps']:,.0f} | {losses} |"
                )
            lines.append(f"| {case.name} | {case.seq_len} | {path} {result}")
            print(lines[-1], flush=True)
    return lines


def preset_part(steps: int = 12) -> list[str]:
    """The upstream comparison workload (vocabulary 2,000, bf16 autocast) on both paths."""
    lines = [
        "| path | tokens/s (median of steps 3-12) | peak RSS | losses (first -> last) |",
        "| --- | ---: | ---: | --- |",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        flags = preset_overrides(UPSTREAM_DEBUG, 1, Path(tmp) / "corpus.json")
        for path, chunk in PATHS.items():
            run_dir = Path(tmp) / f"run{chunk}"
            r = train(
                [
                    "--job.config_file",
                    UPSTREAM_DEBUG.config,
                    *flags,
                    "--training.loss_chunk_size",
                    chunk,
                ],
                steps,
                run_dir,
            )
            lines.append(
                f"| {path} | {r['tps']:,.0f} | {r['memory_gib']:.2f} GiB | "
                f"{r['losses'][0]:.5f} -> {r['losses'][-1]:.5f} |"
            )
            print(lines[-1], flush=True)
    return lines


def estimator_part() -> list[str]:
    lines = [
        "| config | path | traced peak per GPU | closed form | closed form vs trace |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, config in ESTIMATOR_CONFIGS:
        for path, chunk in PATHS.items():
            flags = ["--job.config_file", config, "--training.loss_chunk_size", chunk]
            traced, closed = traced_peak_gib(flags, "cuda")
            lines.append(
                f"| {name} | {path} | {traced:.2f} GiB | {closed:.2f} GiB | "
                f"{closed / traced - 1:+.2%} |"
            )
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "trainer", "preset", "estimator"), default="all")
    parser.add_argument("--memory-limit-gib", type=float, default=20.0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    import torch

    lines = [
        "# Chunked linear cross-entropy vs the full logits",
        "",
        f"- commit `{_git('rev-parse', '--short', 'HEAD')}`, torch {torch.__version__}, "
        f"{machine()}; started {started}.",
        f"- command: `python scripts/bench/chunked_loss.py {' '.join(sys.argv[1:])}`",
        "",
    ]
    if args.part in ("all", "trainer"):
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = write_padded_tokenizer(Path(tmp) / "tokenizer")
            lines += ["## One process on CPU, fp32, local batch 1, vocabulary 128,256", ""]
            lines += trainer_part(args.memory_limit_gib, tokenizer) + [""]
    if args.part in ("all", "preset"):
        lines += ["## The upstream-debug preset (`benchmark.py --preset upstream-debug`)", ""]
        lines += preset_part() + [""]
    if args.part in ("all", "estimator"):
        lines += ["## Estimator: per-GPU peak of the ready configs (target cuda)", ""]
        lines += estimator_part() + [""]
    text = "\n".join(lines)
    if args.output is not None:
        args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
