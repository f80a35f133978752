"""torch.compile vs eager for each MoE debug model on one process: tokens/s and peak RSS.

    python scripts/bench/compile_moe.py --output benchmarks/compile_moe_cpu.md

The trainer on one process, fp32, seq 256 x local batch 8, the byte tokenizer, forced
load balancing (the same token counts in both runs), 20 steps; tokens/s is the median over
the steps after the first two (compilation happens in step 1), peak RSS is the process's
high-water mark (compilation included). One inductor cache per run, so each compiled run
pays its compilation.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from scripts.bench.benchmark import _git, machine  # noqa: E402
from scripts.bench.chunked_loss import train  # noqa: E402

MODELS = {
    "DeepSeek-V3": ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"],
    "Qwen3 MoE": ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"],
    "gpt-oss": ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"],
    "Qwen3.5 MoE": ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_moe"],
}
COMMON = [
    "--job.config_file",
    "train_configs/debug_model.toml",
    "--training.mixed_precision_param",
    "float32",
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "8",
    "--debug.moe_force_load_balance",
]
STEPS = 20


def measure(model: list[str], compiled: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        flags = [*COMMON, *model, *(["--compile.enable"] if compiled else [])]
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        return train(flags, STEPS, Path(tmp) / "run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    import torch

    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# torch.compile for MoE models (CPU)",
        "",
        f"- commit `{_git('rev-parse', '--short', 'HEAD')}`, torch {torch.__version__}, "
        f"{machine()}; started {started}.",
        f"- command: `python scripts/bench/compile_moe.py {' '.join(sys.argv[1:])}`",
        "",
        "| model | eager tokens/s | compiled tokens/s | speed-up | eager peak RSS | "
        "compiled peak RSS | loss at step 20 (eager / compiled) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, model in MODELS.items():
        eager, compiled = measure(model, False), measure(model, True)
        lines.append(
            f"| {name} | {eager['tps']:,.0f} | {compiled['tps']:,.0f} | "
            f"{compiled['tps'] / eager['tps']:.2f}x | {eager['memory_gib']:.2f} GiB | "
            f"{compiled['memory_gib']:.2f} GiB | "
            f"{eager['losses'][-1]:.4f} / {compiled['losses'][-1]:.4f} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.output is not None:
        args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
