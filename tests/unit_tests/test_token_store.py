"""Token stores (scripts/data/prepare.py, torchtitan/data/token_store.py): byte-identical
whatever the worker count and after a kill, the same sequence stream as the text dataset they
were made from, reading at random with a flat RSS, and one clear line for bad input."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.launcher import REPO_ROOT
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.data.loader import build_dataloader
from torchtitan.data.token_store import (
    DOCUMENT_DTYPE,
    DOCUMENTS,
    Manifest,
    TokenStore,
    shard_name,
)
from torchtitan.data.tokenizers import ByteTokenizer

PREPARE = REPO_ROOT / "scripts" / "data" / "prepare.py"


def prepare(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PREPARE), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def store_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Three kinds of input: jsonl.gz, jsonl.zst and txt (a glob matches them in order)."""
    import zstandard

    folder = tmp_path_factory.mktemp("corpus")
    rows = [{"text": f"document {i}: " + "lorem ipsum dolor " * (i % 7 + 1)} for i in range(300)]
    lines = [json.dumps(row) + "\n" for row in rows]
    with gzip.open(folder / "a.jsonl.gz", "wt") as f:
        f.write("".join(lines[:150]))
    compressed = zstandard.ZstdCompressor().compress("".join(lines[150:]).encode())
    (folder / "b.jsonl.zst").write_bytes(compressed)
    (folder / "c.txt").write_text("a whole text file is one document\n" * 40)
    return folder


@pytest.fixture(scope="module")
def stdlib_store(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stores") / "stdlib"
    result = prepare("--dataset", "python_stdlib", "--out", str(out), "--shard-tokens", "2000000")
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.slow
def test_the_store_is_the_same_whatever_the_worker_count(corpus, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for out, workers in ((one, "1"), (two, "2")):
        result = prepare(
            "--input",
            str(corpus / "*"),
            "--out",
            str(out),
            "--workers",
            workers,
            "--shard-tokens",
            "4096",
        )
        assert result.returncode == 0, result.stderr
    assert store_digest(one) == store_digest(two)
    manifest = json.loads((one / "manifest.json").read_text())
    assert (
        manifest["documents"] == 301 and manifest["dtype"] == "<u2" and len(manifest["shards"]) > 3
    )
    assert [Path(f["path"]).name for f in manifest["sources"][0]["files"]] == [
        "a.jsonl.gz",
        "b.jsonl.zst",
        "c.txt",
    ]


@pytest.mark.slow
def test_a_killed_prepare_finishes_to_the_same_store(stdlib_store, tmp_path):
    out = tmp_path / "killed"
    args = [
        sys.executable,
        str(PREPARE),
        "--dataset",
        "python_stdlib",
        "--out",
        str(out),
        "--shard-tokens",
        "2000000",
    ]
    proc = subprocess.Popen(
        args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while not (out / "tokens-00001.bin").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "progress.json").exists() and not (out / "manifest.json").exists()
    with pytest.raises(ConfigError, match="no manifest.json, so not a complete token store"):
        _loader(["--training.dataset", "tokens", "--training.dataset_path", str(out)])
    resumed = prepare("--dataset", "python_stdlib", "--out", str(out), "--shard-tokens", "2000000")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: " in resumed.stderr
    assert store_digest(out) == store_digest(stdlib_store)


def _loader(args: list[str], shards: str = "8"):
    config = ConfigManager().parse_args(
        [
            *args,
            "--training.seq_len",
            "512",
            "--training.local_batch_size",
            "4",
            "--training.data_shards",
            shards,
        ]
    )
    return build_dataloader(config.training, None, ByteTokenizer())


def _windows_digest(loader, batches: int) -> str:
    digest = hashlib.sha256()
    for _, (inputs, labels) in zip(range(batches), loader):
        for tensor in (inputs["input"], labels, inputs["document_ids"]):
            digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("shards", ["1", "8"])
def test_a_store_gives_the_text_datasets_sequences(stdlib_store, shards):
    text = _loader([], shards)
    store = _loader(
        ["--training.dataset", "tokens", "--training.dataset_path", str(stdlib_store)], shards
    )
    assert _windows_digest(store, 12) == _windows_digest(text, 12)


def _random_store(folder: Path, shards: int, shard_tokens: int) -> TokenStore:
    """A store of random tokens in documents of 1,000 tokens, written directly and dropped
    from the page cache (the kernel maps more around a cold read than a cached one)."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for index in range(shards):
        tokens = rng.integers(0, 2000, shard_tokens, dtype=np.uint16)
        with open(folder / shard_name(index), "wb") as shard:
            shard.write(tokens.tobytes())
            shard.flush()
            os.fsync(shard.fileno())  # then out of the page cache: reads come cold, as in a run
            os.posix_fadvise(shard.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    total = shards * shard_tokens
    np.arange(0, total, 1000, dtype=DOCUMENT_DTYPE).tofile(folder / DOCUMENTS)
    Manifest(
        dtype="<u2",
        shard_tokens=shard_tokens,
        tokenizer={"fingerprint": "random", "vocab_size": 2000, "path": ""},
        shards=[
            {"file": shard_name(i), "tokens": shard_tokens, "sha256": ""} for i in range(shards)
        ],
        documents=-(-total // 1000),
        tokens=total,
        sources=[],
    ).write(folder)
    return TokenStore(folder)


def _rss_kib() -> int:
    status = Path("/proc/self/status").read_text().splitlines()
    return sum(int(line.split()[1]) for line in status if line.startswith(("RssAnon", "RssFile")))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status")
def test_reading_a_store_at_random_keeps_rss_flat(tmp_path):
    store = _random_store(tmp_path / "random", shards=4, shard_tokens=1 << 25)  # 256 MiB
    starts = np.random.default_rng(1).integers(0, store.num_tokens - 2049, 16_384)
    assert store.tokens(2 * (1 << 25) - 10, 2 * (1 << 25) + 10).shape == (20,)  # across shards
    before = _rss_kib()
    read = sum(store.tokens(int(start), int(start) + 2049).nbytes for start in starts)
    growth = _rss_kib() - before
    assert read > 64 * 2**20 and growth < 16 * 1024, f"{read:,} bytes read, RSS +{growth:,} KiB"


@pytest.mark.slow
def test_bad_input_is_one_line(stdlib_store, corpus, tmp_path):
    def error(result: subprocess.CompletedProcess) -> str:
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        return result.stderr.strip().splitlines()[-1]

    missing = error(
        prepare("--input", str(tmp_path / "nothing*.jsonl"), "--out", str(tmp_path / "o1"))
    )
    assert missing.startswith("error: --input ") and missing.endswith("matches no file")
    (tmp_path / "d.jsonl.bz2").write_bytes(b"x")
    assert "unknown file kind or compression" in error(
        prepare("--input", str(tmp_path / "d.jsonl.bz2"), "--out", str(tmp_path / "o2"))
    )
    (tmp_path / "e.jsonl").write_text('{"txt": "no text field"}\n')
    assert "no field 'text' (--text-field)" in error(
        prepare("--input", str(tmp_path / "e.jsonl"), "--out", str(tmp_path / "o3"))
    )

    other = tmp_path / "other_tokenizer"
    _tokenizer_folder(other)
    with pytest.raises(ConfigError, match=r"made with another tokenizer"):
        from torchtitan.data.tokenizers import HuggingFaceTokenizer

        config = ConfigManager().parse_args(
            ["--training.dataset", "tokens", "--training.dataset_path", str(stdlib_store)]
        )
        build_dataloader(config.training, None, HuggingFaceTokenizer(other))

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for path in stdlib_store.iterdir():
        (truncated / path.name).write_bytes(path.read_bytes())
    shard = truncated / "tokens-00000.bin"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ConfigError, match=r"tokens-00000.bin: 1,000 bytes, the manifest says"):
        _loader(["--training.dataset", "tokens", "--training.dataset_path", str(truncated)])


def _tokenizer_folder(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
    )
    tokenizer.train_from_iterator(["some text to train a tiny tokenizer on"] * 10, trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


def test_a_store_resumes_and_reshards_like_a_text_dataset(stdlib_store):
    """Positions taken by two dp ranks, their merged state loaded by four: the next global
    batch is the same set of sequences."""
    from torchtitan.data import merge_data_states

    args = ["--training.dataset", "tokens", "--training.dataset_path", str(stdlib_store)]
    config = ConfigManager().parse_args(
        [
            *args,
            "--training.seq_len",
            "256",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "8",
            "--training.data_shards",
            "8",
        ]
    )

    def layout(rank, degree):
        return type("Dims", (), {"data_layout": lambda self: (rank, degree)})()

    whole = iter(build_dataloader(config.training, None, ByteTokenizer()))
    reference = torch.cat(
        [next(whole)[1] for _ in range(16)][12:]
    )  # global batch 3: positions 24..31
    config.training.local_batch_size = 4
    halves = [build_dataloader(config.training, layout(r, 2), ByteTokenizer()) for r in range(2)]
    iterators = [iter(loader) for loader in halves]
    for _ in range(3):  # global batches 0..2
        for it in iterators:
            next(it)
    merged = merge_data_states([loader.state_dict() for loader in halves])
    config.training.local_batch_size = 2
    quarters = [build_dataloader(config.training, layout(r, 4), ByteTokenizer()) for r in range(4)]
    for loader in quarters:
        loader.load_state_dict(merged)
    next_batch = torch.cat([next(iter(loader))[1] for loader in quarters])
    assert sorted(map(tuple, next_batch.tolist())) == sorted(map(tuple, reference.tolist()))
