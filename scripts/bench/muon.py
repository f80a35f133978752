"""Muon vs AdamW: optimizer step time and bytes exchanged, and the loss after the same steps.

    python scripts/bench/muon.py --output benchmarks/muon_cpu.md --plot benchmarks/muon_loss.png
    python scripts/bench/muon.py --part step      # the step-time table alone

Part ``step``: the trainer (``benchmark.py``'s run, profiled last step) with AdamW and with
Muon under FSDP 2 and FSDP 4 on the debug model and on Llama 3 1B's dimensions with one
block (``extra_flavors.py``; byte tokenizer), fp32, seq 256: the median step, the profiled
step's ``Optimizer.step`` time, and the bytes a rank sends plus receives in Muon's step,
averaged over the ranks (each fp32 weight matrix crosses the network once to the rank that
orthogonalises it and once back, less that rank's own block: (n - 1) / n of it each way, an
n-th of it per rank; AdamW's step exchanges nothing beyond FSDP's own collectives, which
both runs share).

Part ``loss``: the debug model on one process, seq 256 x local batch 8, 200 steps, each
optimizer at the learning rates of a small sweep (Muon's AdamW part at 8e-4, ``adjust_lr``
original); the table gives the mean loss of the last 10 steps per run, the plot the best
run of each (every curve goes to a JSON file beside the plot).

Part ``switch``: the same runs for a user who switches a config tuned for AdamW to Muon:
AdamW at the config's settings, ``--optimizer.name Muon`` alone (Muon's defaults), and Muon
tuned (``adjust_lr`` original at the sweep's best lr).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from scripts.bench.benchmark import _git, machine, run_trainer  # noqa: E402
from scripts.bench.chunked_loss import train  # noqa: E402

CONFIG = "train_configs/debug_model.toml"
COMMON = [
    "--experimental.custom_import",
    "scripts.bench.extra_flavors",
    "--training.mixed_precision_param",
    "float32",
    "--training.seq_len",
    "256",
]
MUON = ["--optimizer.name", "Muon", "--optimizer.muon.adamw_lr", "8e-4"]
STEP_MODELS = {"debug model": "debugmodel", "1B dimensions, 1 block": "1B_1layer"}
SWEEP = {
    "AdamW": ["8e-4", "1.6e-3", "3.2e-3", "6.4e-3"],
    "Muon": ["1e-2", "2e-2", "4e-2", "8e-2"],
}
LOSS_STEPS = 200
SWITCH = {
    "AdamW, the config's settings": [],
    "Muon, defaults (`--optimizer.name Muon`)": ["--optimizer.name", "Muon"],
    "Muon tuned (`adjust_lr` original, lr 4e-2, AdamW part 8e-4)": [
        *MUON,
        "--optimizer.muon.adjust_lr",
        "original",
        "--optimizer.lr",
        "4e-2",
    ],
}


def muon_exchange_bytes(flavor: str, ranks: int) -> int:
    """Bytes a rank sends plus receives in Muon's step, averaged over the ranks: of every
    fp32 weight matrix of the blocks, all but the owner's block goes to its owner and back,
    each byte sent by one rank and received by another."""
    import torch

    from scripts.bench import extra_flavors  # noqa: F401  (registers the flavors)
    from torchtitan.models.llama3.flavors import llama3_flavors
    from torchtitan.models.llama3.model import Transformer

    with torch.device("meta"):
        model = Transformer(llama3_flavors[flavor])
    matrices = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2
    )
    moved_each_way = 4 * matrices * (ranks - 1) / ranks
    return int(2 * 2 * moved_each_way / ranks)


def step_part() -> list[str]:
    lines = [
        "| model | layout | optimizer | median step | Optimizer.step (profiled step) | "
        "Muon exchange per rank per step |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for name, flavor in STEP_MODELS.items():
        for nproc in (2, 4):
            for optimizer, extra in (("AdamW", []), ("Muon", MUON)):
                args = argparse.Namespace(
                    config=CONFIG, nproc=nproc, steps=12, warmup=3, threads=2 // nproc or 1
                )
                overrides = [*COMMON, "--model.flavor", flavor, *extra]
                with tempfile.TemporaryDirectory() as tmp:
                    stats = run_trainer(args, overrides, Path(tmp))
                exchange = (
                    f"{muon_exchange_bytes(flavor, nproc) / 2**20:,.1f} MiB"
                    if optimizer == "Muon"
                    else "-"
                )
                lines.append(
                    f"| {name} | FSDP {nproc} | {optimizer} | {stats.median_step * 1e3:,.0f} ms "
                    f"| {stats.breakdown['optimizer'] * 1e3:,.1f} ms | {exchange} |"
                )
                print(lines[-1], flush=True)
    return lines


def train_losses(optimizer: str, lr: str, folder: Path) -> list[float]:
    extra = [*MUON, "--optimizer.muon.adjust_lr", "original"] if optimizer == "Muon" else []
    return losses_with([*extra, "--optimizer.lr", lr], folder)


def losses_with(flags: list[str], folder: Path) -> list[float]:
    """The 200 losses of the debug model on one process with ``flags`` added."""
    flags = ["--job.config_file", CONFIG, *COMMON, *flags]
    flags += ["--training.local_batch_size", "8", "--lr_scheduler.warmup_steps", "20"]
    return train(flags, LOSS_STEPS, folder)["losses"]


def switch_part() -> list[str]:
    lines = [
        f"| run | loss at step 1 | mean loss of steps {LOSS_STEPS - 9}-{LOSS_STEPS} |",
        "| --- | ---: | ---: |",
    ]
    for name, flags in SWITCH.items():
        with tempfile.TemporaryDirectory() as tmp:
            losses = losses_with(flags, Path(tmp))
        lines.append(f"| {name} | {losses[0]:.4f} | {statistics.mean(losses[-10:]):.4f} |")
        print(lines[-1], flush=True)
    return lines


def loss_part(plot: Path | None) -> list[str]:
    lines = [
        f"| optimizer | lr | loss at step 1 | mean loss of steps {LOSS_STEPS - 9}-{LOSS_STEPS} |",
        "| --- | ---: | ---: | ---: |",
    ]
    best: dict[str, tuple[float, str, list[float]]] = {}
    curves: dict[str, list[float]] = {}
    for optimizer, lrs in SWEEP.items():
        for lr in lrs:
            with tempfile.TemporaryDirectory() as tmp:
                losses = train_losses(optimizer, lr, Path(tmp))
            curves[f"{optimizer} {lr}"] = losses
            final = statistics.mean(losses[-10:])
            lines.append(f"| {optimizer} | {lr} | {losses[0]:.4f} | {final:.4f} |")
            print(lines[-1], flush=True)
            if optimizer not in best or final < best[optimizer][0]:
                best[optimizer] = (final, lr, losses)
    gap = best["AdamW"][0] - best["Muon"][0]
    lines += [
        "",
        f"Best: AdamW lr {best['AdamW'][1]} {best['AdamW'][0]:.4f}, Muon lr "
        f"{best['Muon'][1]} {best['Muon'][0]:.4f}: Muon lower by {gap:.4f}.",
    ]
    if plot is not None:
        plot.with_suffix(".json").write_text(json.dumps(curves))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for optimizer, (_, lr, losses) in best.items():
            ax.plot(range(1, len(losses) + 1), losses, label=f"{optimizer} (lr {lr})")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title("Llama 3 debug model, 1 process, seq 256 x 8")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
        lines.append(f"\n![loss curves]({plot.name})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "step", "loss", "switch"), default="all")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the best loss curves")
    args = parser.parse_args()
    import torch

    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Muon vs AdamW",
        "",
        f"- commit `{_git('rev-parse', '--short', 'HEAD')}`, torch {torch.__version__}, "
        f"{machine()}; started {started}.",
        f"- command: `python scripts/bench/muon.py {' '.join(sys.argv[1:])}`",
        "",
    ]
    if args.part in ("all", "step"):
        lines += ["## Optimizer step", ""] + step_part() + [""]
    if args.part in ("all", "loss"):
        lines += ["## Loss after the same steps", ""] + loss_part(args.plot) + [""]
    if args.part in ("all", "switch"):
        lines += ["## Switching a config tuned for AdamW to Muon", ""] + switch_part() + [""]
    text = "\n".join(lines)
    if args.output is not None:
        args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
