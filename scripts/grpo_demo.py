"""GRPO on CPU, end to end: a debug model learns sums, then GRPO with the exact-match
reward raises its accuracy on sums it never saw.

    python scripts/grpo_demo.py [--out outputs/grpo_demo] [--pretrain_steps 600] \\
        [--grpo_steps 100] [--plot benchmarks/grpo_demo_cpu.png]

1. Data: every sum ``a+b=c`` with a, b < 50, split at random (fixed seed) into a pre-training
   corpus, the GRPO prompts and an evaluation set (200 each), disjoint.
2. Pre-training: Llama 3's debug model on the corpus through ``run_train.sh`` (byte
   tokenizer; ~7 min on 2 cores for 600 steps).
3. GRPO through ``run_train.sh`` from that checkpoint (``checkpoint.initial_load_path``):
   8 prompts x 8 sampled completions a step, reward ``exact_match``.
4. Greedy decoding of the evaluation set and of the GRPO prompts before and after GRPO.

Prints the numbers as a Markdown table (and writes it to ``{out}/results.md``): greedy
exact match before and after, the mean sampled reward per pass over the prompts, rollout and
training tokens/s. ``--plot`` draws the sampled reward per step and the greedy accuracies
(needs matplotlib: ``pip install -e '.[plot]'``). Re-running reuses finished stages (a
stage's run resumes from its own checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts" / "generate"))

from test_generate import build_model  # noqa: E402

from torchtitan.components.rewards import exact_match  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.generation import generate, load_model_weights  # noqa: E402
from torchtitan.protocols import get_train_spec  # noqa: E402

CONFIG = REPO_ROOT / "train_configs" / "debug_model.toml"
OPERAND_LIMIT = 50
HELD_OUT = 200
SPLIT_SEED = 0
TRAIN_SEED = 0
GROUP = 8
PROMPTS_PER_STEP = 8
MAX_COMPLETION = 4  # two digits, EOS, and room for one wrong digit more


def write_sums(data: Path) -> dict[str, Path]:
    """The three disjoint splits as jsonl: a text corpus and two prompt sets with answers."""
    sums = [(a, b) for a in range(OPERAND_LIMIT) for b in range(OPERAND_LIMIT)]
    random.Random(SPLIT_SEED).shuffle(sums)
    splits = {
        "eval": sums[:HELD_OUT],
        "grpo": sums[HELD_OUT : 2 * HELD_OUT],
        "pretrain": sums[2 * HELD_OUT :],
    }
    data.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, pairs in splits.items():
        files[name] = data / f"{name}.jsonl"
        rows = (
            {"text": f"{a}+{b}={a + b}"}
            if name == "pretrain"
            else {"prompt": f"{a}+{b}=", "answer": str(a + b)}
            for a, b in pairs
        )
        files[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return files


def train(dump: Path, args: list[str]) -> None:
    """One stage through run_train.sh on one process (a finished stage resumes and stops)."""
    env = {**os.environ, "NGPU": "1", "CONFIG_FILE": str(CONFIG)}
    command = ["./run_train.sh", "--job.dump_folder", str(dump), "--metrics.log_freq", "1"]
    command += ["--debug.seed", str(TRAIN_SEED)]
    subprocess.run([*command, *args], cwd=REPO_ROOT, env=env, check=True)


def pretrain(dump: Path, corpus: Path, steps: int) -> Path:
    train(
        dump,
        [
            "--training.dataset",
            "json",
            "--training.dataset_path",
            str(corpus),
            "--training.steps",
            str(steps),
            "--optimizer.lr",
            "3e-3",
            "--checkpoint.enable",
            "--checkpoint.interval",
            str(steps),
        ],
    )
    return dump / "checkpoint" / f"step-{steps}"


def grpo(dump: Path, prompts: Path, start: Path, steps: int) -> Path:
    train(
        dump,
        [
            "--training.dataset",
            "prompts",
            "--training.dataset_path",
            str(prompts),
            "--grpo.enable",
            "--grpo.num_generations",
            str(GROUP),
            "--grpo.max_completion_length",
            str(MAX_COMPLETION),
            "--grpo.reward_funcs",
            "exact_match",
            "--training.seq_len",
            "12",
            "--training.global_batch_size",
            str(GROUP * PROMPTS_PER_STEP),
            "--training.local_batch_size",
            str(GROUP * PROMPTS_PER_STEP),
            "--training.steps",
            str(steps),
            "--optimizer.lr",
            "1e-4",
            "--lr_scheduler.warmup_steps",
            "5",
            "--checkpoint.enable",
            "--checkpoint.interval",
            str(steps),
            "--checkpoint.initial_load_path",
            str(start),
            "--checkpoint.initial_load_model_only",
        ],
    )
    return dump / "checkpoint" / f"step-{steps}"


@torch.no_grad()
def greedy_exact_match(checkpoint: Path, prompts: Path) -> float:
    """The share of ``prompts`` whose greedy completion is the answer (prompts of one token
    length decode as one batch)."""
    job_config = ConfigManager().parse_args(["--job.config_file", str(CONFIG)])
    tokenizer = get_train_spec(job_config.model.name).build_tokenizer_fn(job_config.model)
    device = torch.device("cpu")
    model = build_model(job_config, tokenizer, 16, torch.float32, device, 1)
    load_model_weights(model, checkpoint)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    by_length: dict[int, list[tuple[list[int], dict]]] = {}
    for row in rows:
        ids = tokenizer.encode(row["prompt"], add_bos=True, add_eos=False)
        by_length.setdefault(len(ids), []).append((ids, row))
    right = 0.0
    for length, group in by_length.items():
        batch = torch.tensor([ids for ids, _ in group], device=device)
        out = generate(
            model,
            batch,
            max_new_tokens=MAX_COMPLETION,
            temperature=0.0,
            stop_ids=(tokenizer.eos_id,),
        )
        for tokens, (_, row) in zip(out[:, length:].tolist(), group):
            if tokenizer.eos_id in tokens:
                tokens = tokens[: tokens.index(tokenizer.eos_id)]
            right += exact_match([tokenizer.decode(tokens)], row)[0]
    return right / len(rows)


def read_metrics(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def results_table(accuracy: dict[str, float], records: list[dict], pretrain: list[dict]) -> str:
    steps_per_pass = HELD_OUT // PROMPTS_PER_STEP
    passes = [
        statistics.fmean(r["reward"] for r in records[i : i + steps_per_pass])
        for i in range(0, len(records), steps_per_pass)
    ]
    timed = records[1:]  # the first step includes the start-up
    lines = [
        "| measure | before GRPO | after GRPO |",
        "|---|---|---|",
        f"| greedy exact match, evaluation sums (unseen) | {accuracy['eval before']:.3f} | "
        f"{accuracy['eval after']:.3f} |",
        f"| greedy exact match, GRPO prompts | {accuracy['grpo before']:.3f} | "
        f"{accuracy['grpo after']:.3f} |",
        "",
        "Mean sampled reward (exact match, temperature 1) per pass over the GRPO prompts: "
        + " -> ".join(f"{p:.3f}" for p in passes),
        "",
        f"- GRPO steps: {len(records)}, {GROUP * PROMPTS_PER_STEP} completions each, "
        f"{statistics.median(r['step_time'] for r in timed):.2f} s/step (median)",
        f"- rollout tokens/s: {statistics.median(r['rollout_tps'] for r in timed):.0f} "
        f"(median), GRPO training tokens/s: {statistics.median(r['tps'] for r in timed):.0f}",
        f"- pre-training: {len(pretrain)} steps, loss {pretrain[0]['loss']:.2f} -> "
        f"{pretrain[-1]['loss']:.2f}, {statistics.median(r['tps'] for r in pretrain[1:]):.0f} "
        "tokens/s",
    ]
    return "\n".join(lines) + "\n"


def plot(path: Path, records: list[dict], accuracy: dict[str, float]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install -e '.[plot]'")
    steps = [r["step"] for r in records]
    rewards = [r["reward"] for r in records]
    window = HELD_OUT // PROMPTS_PER_STEP
    smooth = [statistics.fmean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(steps))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, color="0.75", label="sampled reward per step (64 completions)")
    ax.plot(steps, smooth, color="C0", label=f"mean of the last {window} steps (one pass)")
    for key, color in (("eval", "C2"), ("grpo", "C3")):
        label = "evaluation sums" if key == "eval" else "GRPO prompts"
        ax.plot(
            [steps[0], steps[-1]],
            [accuracy[f"{key} before"], accuracy[f"{key} after"]],
            "o",
            color=color,
            label=f"greedy exact match, {label}: before and after GRPO",
        )
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("exact match")
    ax.set_title("GRPO on held-out sums, Llama 3 debug model, CPU")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "grpo_demo")
    parser.add_argument("--pretrain_steps", type=int, default=600)
    parser.add_argument("--grpo_steps", type=int, default=100)
    parser.add_argument("--plot", type=Path, default=None, help="write the plot here (.png)")
    args = parser.parse_args()
    files = write_sums(args.out / "data")
    start = pretrain(args.out / "pretrain", files["pretrain"], args.pretrain_steps)
    end = grpo(args.out / "grpo", files["grpo"], start, args.grpo_steps)
    accuracy = {
        f"{split} {when}": greedy_exact_match(checkpoint, files[split])
        for split in ("eval", "grpo")
        for when, checkpoint in (("before", start), ("after", end))
    }
    records = read_metrics(args.out / "grpo")
    table = results_table(accuracy, records, read_metrics(args.out / "pretrain"))
    (args.out / "results.md").write_text(table)
    print(table)
    if args.plot is not None:
        plot(args.plot, records, accuracy)


if __name__ == "__main__":
    main()
