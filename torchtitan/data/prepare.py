"""Tokenize a corpus once into a token store (``token_store.py``); the command is
``scripts/data/prepare.py``::

    python scripts/data/prepare.py --input 'corpus/*.jsonl.zst' --out stores/web \\
        --tokenizer assets/tokenizer --workers 8
    python scripts/data/prepare.py --dataset python_stdlib --out stores/stdlib

Inputs: ``--input`` globs (in the order given, each sorted) of jsonl / json lines (the
``--text-field``, default ``text``), parquet (that column) and txt (a whole file is one
document), plain, ``.gz`` or ``.zst``; or ``--dataset`` (and ``--dataset-path``): a registered
text dataset, whose documents the store then holds in the text dataset's order, so training on
the store gives the same sequences as training on the text dataset.

Documents are tokenized in order by ``--workers`` processes (chunks of documents, reassembled
in order), so the store is byte-identical whatever the worker count. Every finished shard is
kept, with a ``progress.json`` that says where the input stands: a killed run, started again
with the same arguments, redoes only the unfinished shard. ``manifest.json`` is written last.
``--out`` may be an object store's URL (``s3://bucket/stores/web``): the store is written into
a local temporary folder, then uploaded, its manifest last (resumption is for local folders).
Bad input is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan.config.errors import ConfigError
from torchtitan.data.token_store import (
    DOCUMENT_DTYPE,
    DOCUMENTS,
    MANIFEST,
    Manifest,
    shard_name,
    token_dtype,
)
from torchtitan.protocols.tokenizer import BaseTokenizer
from torchtitan.tools.storage import storage_path, writing_into

PROGRESS = "progress.json"
CHUNK_DOCUMENTS = 256
DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB of uint16
_LOG_EVERY_TOKENS = 1 << 30
_TABLE_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
_COMPRESSIONS = ("", ".gz", ".zst")


# ---------------------------------------------------------------------------- inputs
def input_files(patterns: list[str]) -> list[Path]:
    """The files the globs match, each glob's matches sorted, in the order given."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise ConfigError(f"--input {pattern!r}: matches no file")
        for match in matches:
            path = Path(match)
            if path.is_file():
                _check_kind(path)
                files.append(path)
    return files


def _check_kind(path: Path) -> None:
    name = path.name
    compression = next((c for c in (".gz", ".zst") if name.endswith(c)), "")
    base = name[: len(name) - len(compression)] if compression else name
    if not base.endswith(_TABLE_SUFFIXES):
        kinds = ", ".join(
            s + c for s in _TABLE_SUFFIXES for c in _COMPRESSIONS if s != ".parquet" or not c
        )
        raise ConfigError(f"--input {path}: unknown file kind or compression; supported: {kinds}")
    if base.endswith(".parquet") and compression:
        raise ConfigError(
            f"--input {path}: parquet compresses its own columns; give the .parquet file"
        )


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if path.name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ConfigError(f"--input {path}: .zst needs the zstandard package") from None
        stream = zstandard.ZstdDecompressor().stream_reader(path.open("rb"))
        return io.TextIOWrapper(stream, encoding="utf-8", errors="replace")
    return path.open("r", encoding="utf-8", errors="replace")


def file_texts(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one input file, in file order."""
    base = path.name.removesuffix(".gz").removesuffix(".zst")
    if base.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        if text_field not in table.schema_arrow.names:
            raise ConfigError(f"--input {path}: no column {text_field!r} (--text-field)")
        for batch in table.iter_batches(columns=[text_field]):
            yield from (text or "" for text in batch.column(0).to_pylist())
        return
    with _open_text(path) as handle:
        if base.endswith(".txt"):
            yield handle.read()
            return
        for number, line in enumerate(handle, 1):
            if line.strip():
                yield _json_text(line, path, number, text_field)


def _json_text(line: str, path: Path, number: int, text_field: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--input {path}:{number}: not a JSON line ({e.msg})") from None
    if not isinstance(row, dict) or text_field not in row:
        raise ConfigError(f"--input {path}:{number}: no field {text_field!r} (--text-field)")
    return row[text_field] or ""


def dataset_texts(name: str, path: str | None, hf: Any = None) -> Iterator[str]:
    """The documents of a registered text dataset, in its order (``hf``: how to read an
    ``hf`` dataset)."""
    from torchtitan.data.registry import load_documents

    try:
        config, documents = load_documents(name, path, section="prepare", hf=hf)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        raise ConfigError(str(e)) from None
    if config.chat or config.preference:
        kind = "chat" if config.chat else "preference"
        raise ConfigError(
            f"--dataset {name!r}: {kind} data is packed whole with its labels; train on it directly"
        )
    return (config.text_processor(document) for document in documents)


def file_record(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


# ---------------------------------------------------------------------------- tokenizing
TokenizerFactory = Callable[[], BaseTokenizer]
"""Builds the tokenizer (picklable: worker processes call it too)."""

_WORKER_TOKENIZER: BaseTokenizer | None = None


def _init_worker(make_tokenizer: TokenizerFactory) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = make_tokenizer()


def _encode_chunk(texts: list[str]) -> list[list[int]]:
    return [_WORKER_TOKENIZER.encode(text) for text in texts]


def _chunks(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def encoded_documents(
    texts: Iterable[str], make_tokenizer: TokenizerFactory, workers: int
) -> Iterator[list[int]]:
    """Each document's ids (BOS and EOS around it, as the text datasets encode), in order."""
    if workers <= 1:
        _init_worker(make_tokenizer)
        for chunk in _chunks(texts, CHUNK_DOCUMENTS):
            yield from _encode_chunk(chunk)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(make_tokenizer,)) as pool:
        for encoded in pool.imap(_encode_chunk, _chunks(texts, CHUNK_DOCUMENTS), chunksize=1):
            yield from encoded


# ---------------------------------------------------------------------------- writing
@dataclass
class Progress:
    """What the finished shards hold: their entries, the tokens and document starts written,
    and which input document continues into the next shard (and how many of its tokens are
    already written)."""

    shards: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    documents: int = 0
    next_document: int = 0
    next_document_offset: int = 0
    inputs: dict[str, Any] = field(default_factory=dict)


class StoreWriter:
    """Appends documents to fixed-size token shards; a shard is published (renamed from
    ``.tmp``) when full, then the progress file records it."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, progress: Progress) -> None:
        self.out, self.dtype, self.shard_tokens, self.progress = out, dtype, shard_tokens, progress
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._starts = open(out / DOCUMENTS, "r+b" if (out / DOCUMENTS).exists() else "wb")
        self._starts.truncate(progress.documents * DOCUMENT_DTYPE.itemsize)
        self._starts.seek(0, os.SEEK_END)
        self._document = progress.next_document

    def add(self, ids: list[int], skip: int = 0) -> None:
        """Document ``self._document``'s ids, its first ``skip`` ones already written."""
        if skip == 0:
            position = self.progress.tokens + self._buffered
            self._starts.write(np.array([position], dtype=DOCUMENT_DTYPE).tobytes())
        tokens = np.asarray(ids[skip:], dtype=self.dtype)
        while len(tokens):
            take = min(len(tokens), self.shard_tokens - self._buffered)
            self._buffer.append(tokens[:take])
            self._buffered += take
            tokens = tokens[take:]
            if self._buffered == self.shard_tokens:
                self._publish(document_continues=len(tokens) > 0, written=len(ids) - len(tokens))
        self._document += 1

    def _publish(self, document_continues: bool, written: int) -> None:
        data = np.concatenate(self._buffer) if self._buffer else np.zeros(0, self.dtype)
        name = shard_name(len(self.progress.shards))
        tmp = self.out / f"{name}.tmp"
        tmp.write_bytes(data.tobytes())
        tmp.replace(self.out / name)
        self._starts.flush()
        p = self.progress
        p.shards.append(
            {
                "file": name,
                "tokens": len(data),
                "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
            }
        )
        p.tokens += len(data)
        p.documents = self._starts.tell() // DOCUMENT_DTYPE.itemsize
        p.next_document = self._document if document_continues else self._document + 1
        p.next_document_offset = written if document_continues else 0
        _write_json(self.out / PROGRESS, p.__dict__)
        self._buffer, self._buffered = [], 0

    def finish(self) -> None:
        if self._buffered or not self.progress.shards:
            self._publish(document_continues=False, written=0)
            self.progress.next_document = self._document
        self._starts.close()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------------------- the command
def _inputs(args: argparse.Namespace) -> tuple[dict[str, Any], Iterable[str]]:
    """(what the manifest records about the inputs, the documents' texts)."""
    if args.dataset:
        record = {"dataset": args.dataset, "dataset_path": args.dataset_path}
        hf = _hf_options(args) if args.dataset == "hf" else None
        if hf is not None:
            record["hf"] = dataclasses.asdict(hf)
        return record, dataset_texts(args.dataset, args.dataset_path, hf)
    files = input_files(args.input)
    record = {"files": [file_record(f) for f in files], "text_field": args.text_field}
    texts = (text for f in files for text in file_texts(f, args.text_field))
    return record, texts


def _hf_options(args: argparse.Namespace) -> Any:
    """``--dataset hf``'s options: the configuration name, the split, the text column
    (``--text-field``) and streaming."""
    from torchtitan.config import HFDatasetConfig

    return HFDatasetConfig(
        name=getattr(args, "hf_name", None),
        split=getattr(args, "hf_split", "train"),
        text_column=args.text_field,
        streaming=getattr(args, "streaming", False),
    )


def _resume(out: Path, inputs: dict[str, Any], tokenizer: dict[str, Any]) -> Progress:
    path = out / PROGRESS
    if not path.exists():
        if any(out.iterdir()):
            raise ConfigError(
                f"--out {out}: not empty and not an interrupted prepare; use an empty folder"
            )
        return Progress(inputs={"inputs": inputs, "tokenizer": tokenizer})
    progress = Progress(**json.loads(path.read_text()))
    if progress.inputs != {"inputs": inputs, "tokenizer": tokenizer}:
        raise ConfigError(
            f"--out {out}: an interrupted prepare of other inputs or another tokenizer; "
            "use an empty folder or the same arguments"
        )
    for stale in out.glob("*.tmp"):
        stale.unlink()
    for extra in sorted(out.glob("tokens-*.bin"))[len(progress.shards) :]:
        extra.unlink()
    print(
        f"resuming: {len(progress.shards)} finished shard(s), {progress.tokens:,} tokens kept",
        file=sys.stderr,
    )
    return progress


def prepare(args: argparse.Namespace, make_tokenizer: TokenizerFactory) -> Manifest:
    """Write (or finish) the store ``args`` describe; see the module docstring. A store on
    an object store (``--out s3://...``) is written into a local temporary folder and
    uploaded, its manifest last (an interrupted upload is no store; it starts afresh)."""
    destination = storage_path(args.out, "--out")
    if (destination / MANIFEST).exists():
        raise ConfigError(f"--out {destination}: already holds a complete token store")
    with writing_into(destination, last=MANIFEST) as out:
        return _prepare_into(out, args, make_tokenizer)


def _prepare_into(
    out: Path, args: argparse.Namespace, make_tokenizer: TokenizerFactory
) -> Manifest:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    identity = {
        "fingerprint": tokenizer.fingerprint(),
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "path": args.tokenizer,
    }
    inputs, texts = _inputs(args)
    progress = _resume(out, inputs, identity)
    dtype = token_dtype(tokenizer.vocab_size)
    writer = StoreWriter(out, dtype, args.shard_tokens, progress)
    skip_documents, skip_tokens = progress.next_document, progress.next_document_offset
    with _Counter(progress.tokens) as counter:
        documents = encoded_documents(
            _skipping(texts, skip_documents), make_tokenizer, args.workers
        )
        for index, ids in enumerate(documents):
            writer.add(ids, skip=skip_tokens if index == 0 else 0)
            counter.update(len(ids))
        writer.finish()
    manifest = Manifest(
        dtype=dtype.str,
        shard_tokens=args.shard_tokens,
        tokenizer=identity,
        shards=progress.shards,
        documents=progress.documents,
        tokens=progress.tokens,
        sources=[inputs],
    )
    manifest.write(out)
    (out / PROGRESS).unlink()
    return manifest


def _skipping(texts: Iterable[str], count: int) -> Iterator[str]:
    for index, text in enumerate(texts):
        if index >= count:
            yield text


class _Counter:
    """Progress on stderr: a bar with documents, tokens and tokens/s on a terminal; one line
    per 2**30 tokens elsewhere (a log). Cleared when done or failed, so an error stays the
    last line."""

    def __init__(self, tokens: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            unit=" docs",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=1.0,
            leave=False,
            disable=not sys.stderr.isatty(),
        )
        self._tokens, self._new_tokens, self._logged = tokens, 0, tokens
        self._start = time.monotonic()

    def __enter__(self) -> _Counter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()

    def update(self, tokens: int) -> None:
        self._tokens += tokens
        self._new_tokens += tokens
        self._bar.update(1)
        rate = self._new_tokens / max(time.monotonic() - self._start, 1e-9)
        if not self._bar.disable:
            self._bar.set_postfix_str(
                f"{self._tokens:,} tokens, {rate:,.0f} tokens/s", refresh=False
            )
        elif self._tokens - self._logged >= _LOG_EVERY_TOKENS:
            self._logged = self._tokens
            print(
                f"prepare: {self._bar.n:,} documents, {self._tokens:,} tokens, "
                f"{rate:,.0f} tokens/s",
                file=sys.stderr,
                flush=True,
            )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", action="append", help="a glob of input files (repeatable)")
    source.add_argument(
        "--dataset",
        help="a registered text dataset (e.g. python_stdlib), or hf (any Hugging Face "
        "dataset: --dataset-path is its hub id or local folder)",
    )
    parser.add_argument("--dataset-path", help="the dataset's files, for file datasets and hf")
    parser.add_argument("--hf-name", help="hf: the dataset's configuration name")
    parser.add_argument("--hf-split", default="train", help="hf: the split (default: train)")
    parser.add_argument(
        "--streaming", action="store_true", help="hf: stream the rows instead of loading the split"
    )
    parser.add_argument(
        "--text-field", default="text", help="JSON field / parquet / hf column (default: text)"
    )
    parser.add_argument("--tokenizer", default="byte", help="a tokenizer folder, or byte (default)")
    parser.add_argument(
        "--out", required=True, help="the store folder (empty, or an interrupted prepare's)"
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    parser.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file"
    )
    args = parser.parse_args(argv)
    if args.workers < 1 or args.shard_tokens < 1:
        raise ConfigError("--workers and --shard-tokens must be >= 1")
    return args
