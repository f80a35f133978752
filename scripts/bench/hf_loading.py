"""Loader throughput per rank for every dataset kind with 0, 1 and 2 worker processes, and the
memory of reading a local parquet set larger than 2 GiB through the Hugging Face source::

    python scripts/bench/hf_loading.py --output benchmarks/hf_loading_cpu.md

1. tokens/s of one rank's loader (batches of 8 x 2048, 8 data shards, upstream's 2,000-token
   test BPE) over the embedded corpus as: the text dataset, 8 parquet files through
   ``dataset = "hf"`` (map-style and streaming), a token store of it, and a mixture of the
   store (0.7) and the streamed parquet files (0.3). Worker start-up is not counted (the clock
   starts after the first batch).
2. a parquet set of random words larger than 2 GiB (16 files, written uncompressed so the
   files hold that many bytes, in row groups of 1,000 documents, ~10 MB; dropped from the page
   cache after writing), of which one rank (a fresh process, 8 data shards: 2 files each, the
   byte tokenizer) reads ``--read-gib`` GiB, streaming and map-style: anonymous RSS (what the
   process allocates) and file-backed RSS (file pages mapped into it) as the read goes.
"""

from __future__ import annotations

import argparse
import json
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
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from torchtitan.config import ConfigManager
from torchtitan.data import load_documents
from torchtitan.data.loader import build_dataloader
from torchtitan.data.prepare import prepare
from torchtitan.data.tokenizers import ByteTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.data_loading import (  # noqa: E402
    REPO,
    TOKENIZER,
    git_commit,
    memory_kib,
    mib,
    tokenizer,
)

SEQ_LEN, BATCH = 2048, 8
ROW_GROUP_ROWS = 1000  # ~10 MB of these documents: datasets' streaming reads a row group whole


def write_corpus_parquet(folder: Path, files: int) -> None:
    """The embedded corpus's documents, in order, as ``files`` parquet files."""
    _, documents = load_documents("python_stdlib", None)
    texts = list(documents)
    folder.mkdir(parents=True)
    size = -(-len(texts) // files)
    for k in range(files):
        pq.write_table(
            pa.table({"text": texts[k * size : (k + 1) * size]}), folder / f"{k}.parquet"
        )


def make_store(source: Path, out: Path) -> None:
    args = Namespace(
        dataset="python_stdlib",
        input=None,
        dataset_path=None,
        text_field="text",
        tokenizer=str(TOKENIZER),
        out=str(out),
        workers=2,
        shard_tokens=1 << 24,
    )
    prepare(args, tokenizer)


def loader_throughput(dataset_args: list[str], workers: int, batches: int) -> float:
    config = ConfigManager().parse_args(
        [
            *dataset_args,
            *("--model.tokenizer_path", str(TOKENIZER)),
            *("--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(BATCH)),
            *("--training.data_shards", "8"),
            *("--training.dataloader.num_workers", str(workers)),
        ]
    )
    loader = build_dataloader(config.training, None, tokenizer())
    batches_iter = iter(loader)
    next(batches_iter)  # opening files, starting workers, first documents
    start = time.perf_counter()
    for _ in range(batches):
        next(batches_iter)
    rate = batches * BATCH * SEQ_LEN / (time.perf_counter() - start)
    loader.close()
    return rate


def write_large_parquet(folder: Path, gib: float, files: int) -> int:
    """``files`` uncompressed parquet files of random-word documents, ``gib`` GiB of text in
    all, then dropped from the page cache. Returns the bytes on disk."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = [
        "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), n))
        for n in rng.integers(2, 10, 4096)
    ]
    pool = " ".join(rng.choice(words, 2_000_000))  # ~12 MB of text to cut documents from
    per_file = int(gib * 2**30 / files)
    for k in range(files):
        texts, written = [], 0
        while written < per_file:
            start, length = int(rng.integers(0, len(pool) - 20_000)), int(rng.integers(500, 20_000))
            texts.append(pool[start : start + length])
            written += length
        path = folder / f"part-{k:02d}.parquet"
        pq.write_table(
            pa.table({"text": texts}), path, compression="none", row_group_size=ROW_GROUP_ROWS
        )
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return sum(p.stat().st_size for p in folder.iterdir())


def read_large_parquet(folder: Path, streaming: bool, total_bytes: int) -> dict[str, Any]:
    """Read ``total_bytes`` of the set as one rank, in a fresh process (what a rank
    is: the writing and the throughput runs leave this process's allocator large); RSS before
    and at 8 points, and the tokens/s."""
    command = [sys.executable, __file__, "--read", str(folder), "--bytes", str(total_bytes)]
    result = subprocess.run(
        command + (["--streaming"] if streaming else []),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def read_as_a_rank(folder: Path, streaming: bool, total_bytes: int) -> dict[str, Any]:
    flags = ["--training.dataset", "hf", "--training.dataset_path", str(folder)]
    flags += ["--training.hf.streaming"] if streaming else []
    config = ConfigManager().parse_args(
        [
            *flags,
            *("--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(BATCH)),
            *("--training.data_shards", "8"),
        ]
    )
    before = memory_kib()
    loader = iter(build_dataloader(config.training, None, ByteTokenizer()))
    batches = total_bytes // (BATCH * (SEQ_LEN + 1))
    samples, start = [], time.perf_counter()
    for index in range(1, batches + 1):
        next(loader)
        if index % (batches // 8) == 0:
            samples.append((index * BATCH * (SEQ_LEN + 1), memory_kib()))
    rate = batches * BATCH * SEQ_LEN / (time.perf_counter() - start)
    return {"before": before, "samples": samples, "rate": rate}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--large-gib", type=float, default=2.2)
    parser.add_argument("--read-gib", type=float, default=0.5, help="how much of it is read")
    parser.add_argument("--read", type=Path, help=argparse.SUPPRESS)  # one rank's read
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--streaming", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read:
        print(json.dumps(read_as_a_rank(args.read, args.streaming, args.bytes)))
        return
    lines = [
        "# Loaders per dataset kind and worker count, and reading a large parquet set",
        "",
        f"- command: `python scripts/bench/hf_loading.py {' '.join(sys.argv[1:])}`",
        f"- commit: `{git_commit()}`",
        f"- Python {platform.python_version()}, {os.cpu_count()} CPU cores, date "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="hf_bench_") as tmp:
        root = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(root / "hf_cache")
        import datasets

        datasets.config.HF_DATASETS_CACHE = str(root / "hf_cache")
        datasets.disable_progress_bars()
        corpus = root / "corpus"
        write_corpus_parquet(corpus, 8)
        make_store(corpus, root / "store")
        hf = ["--training.dataset", "hf", "--training.dataset_path", str(corpus)]
        mixture = (
            f"dataset=tokens,dataset_path={root / 'store'},weight=0.7;"
            f"dataset=hf,dataset_path={corpus},hf.streaming=true,weight=0.3"
        )
        kinds = {
            "text (python_stdlib)": [],
            "hf parquet, map-style": hf,
            "hf parquet, streaming": [*hf, "--training.hf.streaming"],
            "token store": [
                "--training.dataset",
                "tokens",
                "--training.dataset_path",
                str(root / "store"),
            ],
            "mixture (store 0.7, streamed hf 0.3)": ["--training.mixture", mixture],
        }
        lines += [
            f"## one rank's loader: tokens/s (batches of {BATCH} x {SEQ_LEN}, {args.batches} "
            "batches, upstream's 2,000-token test BPE)",
            "",
            "| dataset | 0 workers | 1 worker | 2 workers |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, flags in kinds.items():
            rates = [loader_throughput(flags, workers, args.batches) for workers in (0, 1, 2)]
            lines.append(f"| {name} | " + " | ".join(f"{rate:,.0f}" for rate in rates) + " |")
            print(lines[-1], flush=True)
        large = root / "large"
        on_disk = write_large_parquet(large, args.large_gib, 16)
        lines += [
            "",
            f"## reading {args.read_gib:g} GiB of a {on_disk / 2**30:.2f} GiB parquet set (16 "
            "uncompressed files, cold page cache, one rank with 8 data shards, byte tokenizer)",
        ]
        for streaming in (True, False):
            read = read_large_parquet(large, streaming, int(args.read_gib * 2**30))
            before, samples, rate = read["before"], read["samples"], read["rate"]
            kind = "streaming" if streaming else "map-style (after datasets' Arrow conversion)"
            lines += [
                "",
                f"### {kind}",
                "",
                f"before reading: RssAnon {mib(before['RssAnon'])} MiB, RssFile "
                f"{mib(before['RssFile'])} MiB; read at {rate:,.0f} tokens/s",
                "",
                "| bytes read | RssAnon (MiB) | RssFile (MiB) |",
                "| ---: | ---: | ---: |",
            ]
            for read, memory in samples:
                lines.append(
                    f"| {read / 2**20:,.0f} MiB | {mib(memory['RssAnon'])} | "
                    f"{mib(memory['RssFile'])} |"
                )
                print(lines[-1], flush=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        lines.append(f"\npeak RSS of the whole benchmark process: {mib(peak)} MiB")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
