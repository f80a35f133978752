"""A pre-tokenized token store: written once by ``scripts/data/prepare.py``,
read by positioned reads (``os.pread``) of just the tokens a sequence needs, so a rank's RSS
stays flat however large the store is and however much of it is read. A store on an object
store (``s3://...``, ``storage.py``) is read the same way with ranged GETs, nothing cached
locally, only its document index (8 bytes per document) read whole into memory.

Layout of a store folder:

- ``tokens-NNNNN.bin``: the token ids of all documents back to back, in fixed-size shards of
  ``shard_tokens`` tokens (the last one shorter), little-endian ``uint16`` when the vocabulary
  fits, else ``uint32``;
- ``documents.bin``: one little-endian ``uint64`` per document, the global token offset where
  it starts (document ``d`` spans ``[start[d], start[d + 1])``, the last one up to the total);
- ``manifest.json``, written last (a store without it is incomplete): the format, dtype and
  shard size, the tokenizer's fingerprint and vocabulary, the source files (sizes, sha256),
  every shard's token count and sha256, and the document and token counts.

Documents are stored encoded the way the text datasets encode them (BOS and EOS around each),
so a store packs into the same sequences as the text dataset it was made from.
"""

from __future__ import annotations

import json
import mmap
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from torchtitan.tools.storage import is_object_store, storage_path

FORMAT = "torchtitan-token-store-1"
MANIFEST = "manifest.json"
DOCUMENTS = "documents.bin"
DOCUMENT_DTYPE = np.dtype("<u8")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of the vocabulary."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(index: int) -> str:
    return f"tokens-{index:05d}.bin"


class StoreError(ValueError):
    """A store that cannot be read as it is; the message names the folder and the fix."""


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` records (see the module docstring)."""

    dtype: str
    shard_tokens: int
    tokenizer: dict[str, Any]
    shards: list[dict[str, Any]]
    documents: int
    tokens: int
    sources: list[dict[str, Any]]

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        if not path.is_file():
            raise StoreError(
                f"{folder}: no {MANIFEST}, so not a complete token store; run "
                "python scripts/data/prepare.py (again, to finish it)"
            )
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise StoreError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
            return cls(**{name: data[name] for name in cls.__dataclass_fields__})
        except (ValueError, KeyError, TypeError) as e:
            if isinstance(e, StoreError):
                raise
            raise StoreError(
                f"{path}: not a token-store manifest ({type(e).__name__}: {e})"
            ) from None

    def write(self, folder: Path) -> None:
        data = {"format": FORMAT, **self.__dict__}
        tmp = folder / f"{MANIFEST}.tmp"
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(folder / MANIFEST)


class TokenStore:
    """Random access to the documents of a store folder."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = storage_path(folder, "token store")
        if not self.folder.is_dir():
            raise StoreError(f"{self.folder}: no such token-store folder")
        self.manifest = Manifest.read(self.folder)
        self.dtype = np.dtype(self.manifest.dtype)
        self._remote = is_object_store(self.folder)
        self._filesystem: tuple[int, Any] | None = None
        self._shard_files: list[int] = []
        weakref.finalize(self, _close_all, self._shard_files)  # also those opened before an error
        self._shard_files.extend(self._open_shard(entry) for entry in self.manifest.shards)
        self._shard_tokens = [entry["tokens"] for entry in self.manifest.shards]
        self._shard_starts = np.cumsum([0] + self._shard_tokens)
        self.starts = self._map_documents()

    def _open_shard(self, entry: dict[str, Any]) -> int:
        path = self.folder / entry["file"]
        expected = entry["tokens"] * self.dtype.itemsize
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            found = "missing" if size is None else f"{size:,} bytes"
            raise StoreError(
                f"{path}: {found}, the manifest says {expected:,} bytes (truncated or "
                "replaced); prepare the store again"
            )
        return -1 if self._remote else os.open(path, os.O_RDONLY)

    def _map_documents(self) -> np.ndarray:
        path = self.folder / DOCUMENTS
        expected = self.manifest.documents * DOCUMENT_DTYPE.itemsize
        if not path.is_file() or path.stat().st_size != expected:
            raise StoreError(
                f"{path}: not the {self.manifest.documents:,} document offsets the manifest "
                "records (truncated or replaced); prepare the store again"
            )
        if self._remote:
            return np.frombuffer(self._fs().cat_file(path.path), dtype=DOCUMENT_DTYPE)
        return np.memmap(path, dtype=DOCUMENT_DTYPE, mode="r")

    def _fs(self) -> Any:
        """The object store's filesystem of this process (a loader worker makes its own: a
        client's connections do not survive a fork)."""
        if self._filesystem is None or self._filesystem[0] != os.getpid():
            fs = fsspec.filesystem(self.folder.protocol, **self.folder.storage_options)
            self._filesystem = (os.getpid(), fs)
        return self._filesystem[1]

    @property
    def num_documents(self) -> int:
        return self.manifest.documents

    @property
    def num_tokens(self) -> int:
        return self.manifest.tokens

    def document_bounds(self, documents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) global token offsets of the given document indices."""
        starts = self.starts[documents].astype(np.int64)
        following = documents + 1
        ends = np.where(
            following < self.num_documents,
            self.starts[np.minimum(following, self.num_documents - 1)].astype(np.int64),
            self.num_tokens,
        )
        _release(self.starts)
        return starts, ends

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Global tokens ``[start, end)``, read with ``os.pread``: the bytes pass through the
        kernel's page cache and nothing stays mapped in the process. (A memory map kept RSS
        growing by about twice the bytes read even with ``MADV_DONTNEED`` after each read:
        the kernel maps neighbouring pages on each fault, which the advice does not cover.)"""
        first = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        pieces = []
        while start < end:
            offset = start - int(self._shard_starts[first])
            take = min(end - start, self._shard_tokens[first] - offset)
            pieces.append(self._read(first, offset, take))
            start, first = start + take, first + 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.dtype)

    def _read(self, shard: int, offset: int, count: int) -> np.ndarray:
        size, start = count * self.dtype.itemsize, offset * self.dtype.itemsize
        if self._remote:
            path = self.folder / self.manifest.shards[shard]["file"]
            data = self._fs().cat_file(path.path, start=start, end=start + size)
        else:
            data = os.pread(self._shard_files[shard], size, start)
        if len(data) != size:
            raise StoreError(
                f"{self.folder / self.manifest.shards[shard]['file']}: shorter than its "
                "manifest says (truncated while in use); prepare the store again"
            )
        return np.frombuffer(bytearray(data), dtype=self.dtype)


def _release(mapped: np.ndarray) -> None:
    """Unmap every page of ``mapped`` the process touched (they stay in the page cache)."""
    mapping = getattr(mapped, "_mmap", None)
    if mapping is not None:
        mapping.madvise(mmap.MADV_DONTNEED)


def _close_all(descriptors: list[int]) -> None:
    for descriptor in descriptors:
        if descriptor >= 0:
            os.close(descriptor)
