"""Token stores against the on-the-fly text path: how fast a store is made, how fast a rank
reads it, and how much memory reading a large one takes::

    python scripts/bench/data_loading.py --output benchmarks/data_loading_cpu.md

1. ``prepare`` throughput (tokens/s) on the embedded corpus with upstream's 2,000-token test
   tokenizer (a real BPE), with 1 and 2 worker processes;
2. loader throughput of one rank (tokens/s of batches of 8 x 2048), the text dataset
   (tokenized while loading) against its store (read with pread), and how many consumers of the
   8B model at H100 speed one CPU core feeds: an H100 at 40% of its 989 dense bf16 TFLOP/s
   trains Llama 3 8B (6 x 8.0e9 FLOPs/token) at ~8,240 tokens/s;
3. the memory of reading a store larger than 2 GiB (random tokens written as a store), its
   sequences in shuffled order, its files first dropped from the page cache: anonymous RSS
   (what the process allocates) and file-backed RSS (file pages mapped into the process).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from torchtitan.config import ConfigManager, ModelConfig
from torchtitan.data.loader import build_dataloader
from torchtitan.data.prepare import prepare
from torchtitan.data.token_store import DOCUMENT_DTYPE, DOCUMENTS, Manifest, shard_name
from torchtitan.data.tokenizers import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "scripts" / "bench" / "upstream_test_tokenizer"
H100_8B_TOKENS_PER_SECOND = 0.4 * 989e12 / (6 * 8.0e9)
SEQ_LEN, BATCH = 2048, 8


def tokenizer():
    return build_tokenizer(ModelConfig(tokenizer_path=str(TOKENIZER)))


def prepare_throughput(root: Path, workers: int) -> tuple[float, int, str]:
    out = root / f"store_w{workers}"
    args = Namespace(
        dataset="python_stdlib",
        input=None,
        dataset_path=None,
        text_field="text",
        tokenizer=str(TOKENIZER),
        out=str(out),
        workers=workers,
        shard_tokens=1 << 24,
    )
    start = time.perf_counter()
    manifest = prepare(args, tokenizer)
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(b"".join((out / s["file"]).read_bytes() for s in manifest.shards))
    return manifest.tokens / seconds, manifest.tokens, digest.hexdigest()[:16]


def loader_config(dataset_args: list[str]):
    """The job config of one rank's loader: ``dataset_args`` with the benchmark's tokenizer,
    sequence length, batch and data shards."""
    return ConfigManager().parse_args(
        [
            *dataset_args,
            "--model.tokenizer_path",
            str(TOKENIZER),
            "--training.seq_len",
            str(SEQ_LEN),
            "--training.local_batch_size",
            str(BATCH),
            "--training.data_shards",
            "8",
        ]
    )


def loader_throughput(dataset_args: list[str], batches: int) -> float:
    config = loader_config(dataset_args)
    loader = iter(build_dataloader(config.training, None, tokenizer()))
    next(loader)  # first batch: opening files, first documents
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * BATCH * SEQ_LEN / (time.perf_counter() - start)


def write_random_store(folder: Path, tokens: int, fingerprint: str, vocab: int) -> None:
    """A store of random tokens in documents of 1,000 (written directly: the reading side is
    what is measured)."""
    folder.mkdir(parents=True)
    shard_tokens, rng = 1 << 28, np.random.default_rng(0)
    shards = []
    for index, start in enumerate(range(0, tokens, shard_tokens)):
        count = min(shard_tokens, tokens - start)
        with open(folder / shard_name(index), "wb") as shard:
            for chunk in range(0, count, 1 << 22):  # 8 MiB at a time: the writer stays small
                size = min(1 << 22, count - chunk)
                shard.write(rng.integers(0, vocab, size, dtype=np.uint16).tobytes())
            shard.flush()
            os.fsync(shard.fileno())  # then dropped from the page cache: reads come cold
            os.posix_fadvise(shard.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        shards.append({"file": shard_name(index), "tokens": count, "sha256": ""})
    np.arange(0, tokens, 1000, dtype=DOCUMENT_DTYPE).tofile(folder / DOCUMENTS)
    Manifest(
        dtype="<u2",
        shard_tokens=shard_tokens,
        tokenizer={"fingerprint": fingerprint, "vocab_size": vocab, "path": str(TOKENIZER)},
        shards=shards,
        documents=-(-tokens // 1000),
        tokens=tokens,
        sources=[],
    ).write(folder)


def memory_kib() -> dict[str, int]:
    status = Path("/proc/self/status").read_text().splitlines()
    values = dict(line.split(":", 1) for line in status if line.startswith(("RssAnon", "RssFile")))
    return {key: int(value.split()[0]) for key, value in values.items()}


def read_large_store(folder: Path, batches: int) -> tuple[list[tuple[int, dict[str, int]]], float]:
    """RSS samples while reading ``batches`` shuffled batches, and the tokens/s of the read."""
    config = loader_config(
        ["--training.dataset", "tokens", "--training.dataset_path", str(folder)]
        + ["--training.shuffle_seed", "1"]
    )
    loader = iter(build_dataloader(config.training, None, tokenizer()))
    samples, start = [], time.perf_counter()
    for index in range(1, batches + 1):
        next(loader)
        if index % (batches // 8) == 0:
            samples.append((index * BATCH * SEQ_LEN * 2, memory_kib()))
    return samples, batches * BATCH * SEQ_LEN / (time.perf_counter() - start)


def git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return result.stdout.strip()


def mib(kib: int) -> str:
    return f"{kib / 1024:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path)
    parser.add_argument("--large-store-gib", type=float, default=2.5)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--read-gib", type=float, default=1.0, help="how much of it is read")
    args = parser.parse_args()
    lines = [
        "# Token stores and the text path on this CPU",
        "",
        f"- command: `python scripts/bench/data_loading.py {' '.join(sys.argv[1:])}`",
        f"- commit: `{git_commit()}`",
        f"- Python {platform.python_version()}, {os.cpu_count()} CPU cores, date "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; tokenizer: upstream's 2,000-token test BPE",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="data_bench_") as tmp:
        root = Path(tmp)
        lines += [
            "## prepare (embedded corpus)",
            "",
            "| workers | tokens | tokens/s | store sha256 (first 16) |",
            "| ---: | ---: | ---: | --- |",
        ]
        for workers in (1, 2):
            rate, tokens, digest = prepare_throughput(root, workers)
            lines.append(f"| {workers} | {tokens:,} | {rate:,.0f} | `{digest}` |")
            print(lines[-1], flush=True)
        store = root / "store_w1"
        text_rate = loader_throughput([], args.batches)
        store_rate = loader_throughput(
            ["--training.dataset", "tokens", "--training.dataset_path", str(store)], args.batches
        )
        lines += [
            "",
            f"## one rank's loader (batches of {BATCH} x {SEQ_LEN}, {args.batches} batches)",
            "",
            "| path | tokens/s | 8B H100 consumers fed per core |",
            "| --- | ---: | ---: |",
        ]
        for name, rate in (
            ("text, tokenized while loading", text_rate),
            ("token store, pread", store_rate),
        ):
            lines.append(f"| {name} | {rate:,.0f} | {rate / H100_8B_TOKENS_PER_SECOND:,.1f} |")
            print(lines[-1], flush=True)
        bpe = tokenizer()
        large = root / "large"
        tokens = int(args.large_store_gib * 2**30 / 2)
        write_random_store(large, tokens, bpe.fingerprint(), bpe.vocab_size)
        before = memory_kib()
        read_batches = int(args.read_gib * 2**30 / (BATCH * SEQ_LEN * 2))
        samples, cold_rate = read_large_store(large, read_batches)
        lines += [
            "",
            f"## reading {args.read_gib:g} GiB of a {args.large_store_gib:g} GiB store, shuffled",
            "",
            f"before reading: RssAnon {mib(before['RssAnon'])} MiB, "
            f"RssFile {mib(before['RssFile'])} MiB; read at {cold_rate:,.0f} tokens/s "
            "(from disk, in shuffled order)",
            "",
            "| bytes of tokens read | RssAnon (MiB) | RssFile (MiB) |",
            "| ---: | ---: | ---: |",
        ]
        for read, memory in samples:
            anon, mapped = mib(memory["RssAnon"]), mib(memory["RssFile"])
            lines.append(f"| {read / 2**20:,.0f} MiB | {anon} | {mapped} |")
            print(lines[-1], flush=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        lines.append(f"\npeak RSS of the whole benchmark process: {mib(peak)} MiB")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
