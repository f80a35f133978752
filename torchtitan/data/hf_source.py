"""Any Hugging Face dataset as a text or chat source (``dataset = "hf"``).

``dataset_path`` is a hub id, a local folder or file of data files (parquet, arrow, json/jsonl,
csv, txt; a folder laid out as a hub repository keeps its splits and configurations), or a
folder written by ``Dataset.save_to_disk``. ``[<section>.hf]`` picks the configuration name,
the split, the text or messages column and ``streaming``.

A rank reads only its own data shards, which are contiguous parts of the dataset (so that a
rank touches only its part of the files, not every row of them):

- map-style (``streaming = false``): the split is loaded by ``datasets`` into its Arrow cache
  (memory-mapped); data shard ``s`` of ``S`` is the ``s``-th of ``S`` contiguous row ranges
  (``datasets``' own contiguous sharding);
- streaming: data shard ``s`` is ``IterableDataset.shard(S, s)``, the ``s``-th contiguous group
  of the dataset's files (a ``save_to_disk`` folder is cut into ``S`` row ranges, the
  map-style order); a resume reopens the shard and skips to its row, tokenizing nothing.

A hub id is read from the local cache when the Hub cannot be reached; one that is not cached
then fails in one line that says so.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from torchtitan.config.errors import ConfigError
from torchtitan.data.hf_datasets import explain_error
from torchtitan.data.sft import ChatSample, checked_messages

if TYPE_CHECKING:
    from torchtitan.config import HFDatasetConfig

_STREAM_BATCH_ROWS = 256

_BUILDERS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".csv": "csv",
    ".txt": "text",
}


def contiguous_range(num_rows: int, num_shards: int, shard: int) -> range:
    """Rows of shard ``shard`` of ``num_shards`` contiguous parts (``datasets``' rule: the
    first ``num_rows % num_shards`` parts hold one row more)."""
    size, rest = divmod(num_rows, num_shards)
    start = size * shard + min(shard, rest)
    return range(start, start + size + (shard < rest))


class HFDocuments:
    """The documents of one split of a Hugging Face dataset, map-style or streamed; each row
    becomes its text (``text_column``) or a ``ChatSample`` (``messages_column``)."""

    def __init__(self, dataset: Any, options: HFDatasetConfig, where: str, section: str) -> None:
        self._dataset = dataset
        self._options = options
        self._where = where
        self._section = section
        self._field = f"{section}.dataset_path"
        self.streaming = options.streaming
        self.chat = options.messages_column is not None

    def __len__(self) -> int:
        if self.streaming:
            raise TypeError("a streamed dataset has no length")
        return len(self._dataset)

    def __iter__(self) -> Iterator[str | ChatSample]:
        """Every document in the dataset's order (what ``prepare`` writes into a store)."""
        if not self.streaming:
            for index in range(len(self._dataset)):
                yield self.document(self.row(index), f"row {index}")
            return
        stream = self._dataset
        if not hasattr(stream, "n_shards"):  # a save_to_disk folder
            stream = stream.to_iterable_dataset()
        for index, row in enumerate(self.rows(stream, 1, 0)):
            yield self.document(row, f"row {index}")

    def document(self, row: dict[str, Any], index: str) -> str | ChatSample:
        if not self.chat:
            return row[self._options.text_column] or ""
        source = f"{self._where} {index}"
        try:
            return ChatSample(checked_messages(row[self._options.messages_column], source), source)
        except ValueError as e:
            raise ConfigError(f"{self._section}.hf.messages_column: {e}") from None

    def shard_documents(self, num_shards: int, shards: Sequence[int], section: str) -> Any:
        """The ``ShardedDocuments`` of the given data shards (``packing.py``)."""
        if not self.streaming:
            return RowRanges(self, num_shards)
        stream = self._dataset
        if not hasattr(stream, "n_shards"):  # a save_to_disk folder: its map-style row ranges
            stream = stream.to_iterable_dataset(num_shards=min(num_shards, len(stream)))
        if num_shards > stream.n_shards:
            raise ValueError(
                f"{section}.data_shards ({num_shards}) exceeds the {stream.n_shards} file "
                f"shards of the streamed dataset {self._where}: every data shard reads whole "
                f"files; lower {section}.data_shards to at most {stream.n_shards} or set "
                f"{section}.hf.streaming = false"
            )
        return ShardStreams(self, stream, num_shards)

    def rows(
        self, stream: Any, num_shards: int, shard: int, skip: int = 0
    ) -> Iterator[dict[str, Any]]:
        """Streaming: the rows of data shard ``shard`` from row ``skip`` on."""
        part = stream.shard(num_shards=num_shards, index=shard, contiguous=True)
        if skip:
            part = part.skip(skip)
        try:
            # in batches: iterating row by row inside a loader worker would let datasets split
            # the shard again among the workers
            for batch in part.iter(batch_size=_STREAM_BATCH_ROWS):
                columns = list(batch.values())
                yield from (dict(zip(batch, values)) for values in zip(*columns))
        except Exception as e:  # a file that breaks mid-stream surfaces as a library error
            raise ConfigError(
                f"{self._field}: cannot read {self._where} (data shard {shard}): {explain_error(e)}"
            ) from None

    def row(self, index: int) -> dict[str, Any]:
        return self._dataset[index]


class RowRanges:
    """Map-style: data shard ``s`` is the ``s``-th contiguous row range."""

    def __init__(self, documents: HFDocuments, num_shards: int) -> None:
        self._documents = documents
        self._ranges = [
            contiguous_range(len(documents), num_shards, shard) for shard in range(num_shards)
        ]

    def get(self, shard: int, epoch: int, j: int) -> Any | None:
        rows = self._ranges[shard]
        if j >= len(rows):
            return None
        return self._documents.document(self._documents.row(rows[j]), f"row {rows[j]}")

    def seek(self, shard: int, epoch: int, j: int) -> None:
        pass

    def iter_epoch(self, shards: Sequence[int]) -> Iterator[tuple[int, Any]]:
        for shard in shards:
            for j in range(len(self._ranges[shard])):
                yield shard, self.get(shard, 0, j)


class ShardStreams:
    """Streaming: one open stream per data shard, positioned at the shard's next row; a read
    elsewhere (a resume, a new epoch) reopens the shard's stream at that row."""

    def __init__(self, documents: HFDocuments, stream: Any, num_shards: int) -> None:
        self._documents = documents
        self._stream = stream
        self._num_shards = num_shards
        self._streams: dict[int, tuple[tuple[int, int], Iterator[dict[str, Any]]]] = {}

    def seek(self, shard: int, epoch: int, j: int) -> None:
        at = self._streams.get(shard)
        if at is None or at[0] != (epoch, j):
            self._streams[shard] = (
                (epoch, j),
                self._documents.rows(self._stream, self._num_shards, shard, j),
            )

    def get(self, shard: int, epoch: int, j: int) -> Any | None:
        self.seek(shard, epoch, j)
        _, rows = self._streams[shard]
        row = next(rows, None)
        self._streams[shard] = (epoch, j + 1), rows
        if row is None:
            return None
        return self._documents.document(row, f"data shard {shard} row {j}")

    def iter_epoch(self, shards: Sequence[int]) -> Iterator[tuple[int, Any]]:
        for shard in shards:
            for j, row in enumerate(self._documents.rows(self._stream, self._num_shards, shard)):
                yield shard, self._documents.document(row, f"data shard {shard} row {j}")


def _hub_reachable() -> bool:
    """Whether the Hugging Face Hub answers a TCP connection (3 s at most)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or os.environ.get(
        "HF_DATASETS_OFFLINE", "0"
    ) not in ("0", ""):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


def _go_offline() -> None:
    """Let ``datasets`` read the local cache only (it read the environment at import)."""
    import datasets
    import huggingface_hub.constants

    datasets.config.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


def _local_data_files(path: Path) -> tuple[str, list[str]] | None:
    """(builder, files) for a single data file; None for a folder (``datasets`` infers it)."""
    if not path.is_file():
        return None
    for suffix, builder in _BUILDERS.items():
        if path.name.endswith(suffix):
            return builder, [str(path)]
    raise ValueError(
        f"{str(path)!r} is not a data file datasets reads (suffixes: {', '.join(_BUILDERS)})"
    )


def _is_saved_to_disk(path: Path) -> bool:
    return path.is_dir() and any(
        (path / marker).exists() for marker in ("state.json", "dataset_dict.json")
    )


def _check_parquet_files(path: Path) -> bool:
    """Every local parquet file has a readable footer (a streaming read would fail only when it
    reaches the file). Returns whether the data files are all parquet."""
    import pyarrow.parquet as pq

    files = [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.is_file()]
    data = [file for file in files if not file.name.startswith(".") and file.suffix != ".md"]
    for file in data:
        if file.name.endswith(".parquet"):
            try:
                pq.read_metadata(file)
            except Exception as e:
                raise ValueError(f"{str(file)!r} is not a readable parquet file ({e})") from None
    return bool(data) and all(file.name.endswith(".parquet") for file in data)


def _unbuffered_parquet() -> Any:
    """Scan options that read a streamed parquet file's column chunks as they are decoded:
    pyarrow's default pre-buffers the file (~40% more memory per open data shard, measured)."""
    import pyarrow.dataset

    return pyarrow.dataset.ParquetFragmentScanOptions(pre_buffer=False)


def _load(path: str, options: HFDatasetConfig, section: str) -> Any:
    import datasets

    local = Path(path)
    if _is_saved_to_disk(local):
        return _load_saved(local, options, section)
    kwargs: dict[str, Any] = {"split": options.split, "streaming": options.streaming}
    if local.exists():
        if _check_parquet_files(local) and options.streaming:
            kwargs["fragment_scan_options"] = _unbuffered_parquet()
        files = _local_data_files(local)
        if files is not None:
            builder, data_files = files
            return datasets.load_dataset(builder, data_files=data_files, **kwargs)
    elif not _hub_reachable():
        _go_offline()
    return datasets.load_dataset(path, name=options.name, **kwargs)


def _load_saved(path: Path, options: HFDatasetConfig, section: str) -> Any:
    import datasets

    if options.name is not None:
        raise ValueError(
            f"{section}.hf.name: {str(path)!r} is a save_to_disk folder, which has no "
            "configurations; unset it"
        )
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if options.split not in dataset:
            raise ValueError(
                f"{section}.hf.split: unknown split {options.split!r} of {str(path)!r}; its "
                f"splits: {', '.join(dataset)}"
            )
        dataset = dataset[options.split]
    elif options.split != "train":
        raise ValueError(
            f"{section}.hf.split: {str(path)!r} holds one split (saved from a Dataset); "
            "leave hf.split at 'train'"
        )
    return dataset


def _explained_load_error(error: Exception, path: str, section: str) -> Exception:
    """The library's error as one line naming the config field to change."""
    message = explain_error(error)
    if "Unknown split" in message:
        return ValueError(f"{section}.hf.split: {message} (dataset {path!r})")
    if "BuilderConfig" in message or "Config name is missing" in message:
        return ValueError(f"{section}.hf.name: {message} (dataset {path!r})")
    if isinstance(error, ConnectionError) or "OfflineModeIsEnabled" in message:
        return ValueError(
            f"{section}.dataset_path: {path!r} is neither a local folder nor in the local "
            f"Hugging Face cache (HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}), "
            "and the Hub cannot be reached (offline); download it where there is internet, or "
            "give a local folder"
        )
    if isinstance(error, FileNotFoundError):
        return ValueError(f"{section}.dataset_path: {message}")
    return ValueError(f"{section}.dataset_path: cannot read {path!r}: {message}")


def _columns(dataset: Any) -> list[str] | None:
    names = dataset.column_names
    if names is None:  # a stream without declared features: look at its first row
        first = next(iter(dataset), None)
        names = list(first) if first is not None else []
    return list(names)


def load_hf_documents(path: str, options: HFDatasetConfig, section: str) -> HFDocuments:
    """The split's documents, checked before any is read for training: the split, the
    configuration name and the column exist; a local parquet file is parquet."""
    try:
        dataset = _load(path, options, section)
    except ValueError as e:
        if str(e).startswith(f"{section}."):
            raise
        raise _explained_load_error(e, path, section) from None
    except Exception as e:  # datasets and pyarrow raise assorted errors for unreadable data
        raise _explained_load_error(e, path, section) from None
    column, field = (
        (options.messages_column, f"{section}.hf.messages_column")
        if options.messages_column is not None
        else (options.text_column, f"{section}.hf.text_column")
    )
    names = _columns(dataset)
    if column not in names:
        raise ValueError(
            f"{field}: dataset {path!r} has no column {column!r} (columns: {', '.join(names)})"
        )
    if not options.streaming and len(dataset) == 0:
        raise ValueError(f"{section}.dataset_path: split {options.split!r} of {path!r} has no rows")
    return HFDocuments(dataset, options, repr(path), section)
