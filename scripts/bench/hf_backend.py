"""The hf backend (transformers' modules) beside the native model of the same shape: training
tokens/s and peak memory per process, through the real entry point::

    python scripts/bench/hf_backend.py --output benchmarks/hf_backend_cpu.md

The native model's flavor (``--model``, ``--flavor``: Llama 3 or Qwen3) is written as a Hugging
Face ``config.json`` by its own state-dict adapter, so ``model.name = "hf"`` builds
transformers' ``LlamaForCausalLM`` (``Qwen3ForCausalLM``) of the same shape (dim, layers,
heads, FFN, vocabulary of the test tokenizer). Both train
``--steps`` steps in one process (fp32, batch ``--batch`` x ``--seq-len``, the chunked loss),
alternating ``--repeats`` times; the table gives the median over runs of each run's median
tokens/s after the first 3 steps (compile-free warm-up), and the largest ``memory_gib`` the
trainer logged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "scripts" / "bench" / "upstream_test_tokenizer"
WARMUP = 3
HF_CLASSES = {"llama3": "Llama", "qwen3": "Qwen3"}


def write_hf_folder(model: str, flavor: str, folder: Path) -> None:
    """config.json of the native model's flavor (with the test tokenizer's vocabulary) and
    the tokenizer files."""
    from torchtitan.config import ConfigManager
    from torchtitan.data.tokenizers import build_tokenizer
    from torchtitan.protocols.train_spec import get_train_spec

    config = ConfigManager().parse_args(
        [
            "--model.name",
            model,
            "--model.flavor",
            flavor,
            "--model.tokenizer_path",
            str(TOKENIZER),
        ]
    )
    spec = get_train_spec(model)
    args = spec.flavor_args(flavor)
    args.update_from_config(config.model, max_seq_len=4096, tokenizer=build_tokenizer(config.model))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(spec.hf_adapter(args).hf_config(), indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)


def train(model_flags: list[str], args: argparse.Namespace, dump: Path) -> list[dict]:
    cmd = [
        sys.executable,
        *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"),
        *("-m", "torchtitan.train", *model_flags),
        *("--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch)),
        *("--training.steps", str(args.steps), "--training.mixed_precision_param", "float32"),
        *("--metrics.log_freq", "1", "--job.dump_folder", str(dump)),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("llama3", "qwen3"), default="llama3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", help="write the markdown table here")
    args = parser.parse_args()
    native, hf = f"native {args.model}", f"hf (transformers' {HF_CLASSES[args.model]})"
    rates: dict[str, list[float]] = {native: [], hf: []}
    memory: dict[str, float] = dict.fromkeys(rates, 0.0)
    with tempfile.TemporaryDirectory(prefix="hf_backend_") as tmp:
        root = Path(tmp)
        write_hf_folder(args.model, args.flavor, root / "hf")
        flags = {
            native: ["--model.name", args.model, "--model.flavor", args.flavor]
            + ["--model.tokenizer_path", str(TOKENIZER)],
            hf: ["--model.name", "hf", "--model.flavor", "full"]
            + ["--model.hf_assets_path", str(root / "hf")],
        }
        for repeat in range(args.repeats):
            for name, model_flags in flags.items():
                records = train(model_flags, args, root / f"{len(rates[name])}_{repeat}_{name[:2]}")
                rates[name].append(statistics.median(r["tps"] for r in records[WARMUP:]))
                memory[name] = max(memory[name], *(r["memory_gib"] for r in records))
                print(name, f"{rates[name][-1]:,.0f} tokens/s", flush=True)
    lines = [
        "# The hf backend beside the native model (same shape)",
        "",
        f"- command: `python scripts/bench/hf_backend.py {' '.join(sys.argv[1:])}`",
        f"- {HF_CLASSES[args.model]} `{args.flavor}` shape, one process, fp32, batch "
        f"{args.batch} x seq {args.seq_len}, {args.steps} steps x {args.repeats} alternating "
        f"runs; Python {platform.python_version()}, {os.cpu_count()} CPU cores, "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        "| model | tokens/s (median of runs) | runs | peak memory (GiB) |",
        "| --- | ---: | --- | ---: |",
    ]
    for name in rates:
        runs = ", ".join(f"{rate:,.0f}" for rate in rates[name])
        lines.append(
            f"| {name} | {statistics.median(rates[name]):,.0f} | {runs} | {memory[name]:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
