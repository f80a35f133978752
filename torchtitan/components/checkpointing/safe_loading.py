"""The one way torchtitan reads checkpoints and weights that a user hands it.

Every reader of a torch.distributed.checkpoint (DCP) folder or a folder of Hugging Face
weights goes through this module (trainer resume, initial loads, seed checkpoints,
generation, the conversion scripts); ``tests/integration_tests/test_hardened_loading.py`` greps the
code base so that nothing else unpickles, ``torch.load``s or ``dcp.load``s user files.

What it guarantees, for DCP folders:

- ``.metadata`` is unpickled through an allow-list (DCP's own data classes, ``torch.Size``,
  dtypes), then checked field by field: a crafted metadata cannot supply attributes that
  later code trusts.
- Only the files DCP writes (``.metadata``, ``__R_I.distcp``) and ``checkpoint.json`` are
  read; the metadata may point only at ``.distcp`` files of the folder, within their size,
  with no storage transforms.
- Every entry to be loaded is checked against what the metadata describes before any data
  is read: a tensor of the model must be stored as a tensor of the same shape and dtype kind
  (floating point stays floating point; a bf16 export loads into fp32), a non-tensor entry
  (optimizer hyper-parameters) as bytes. Bytes are decoded with ``torch.load(weights_only=
  True)``; tensor data is read by DCP with ``weights_only=True``.

For Hugging Face folders: only ``config.json`` and ``*.safetensors`` files are read (no
pickle-based ``.bin``/``.pt``, no ``*.py``), and no ``trust_remote_code`` path exists. A
``config.json`` that names remote code (``auto_map``, as official releases with custom
modelling code do) loads only when it describes an architecture torchtitan builds itself; the
code and any pickle files beside it are named in one warning and never read.

A DCP folder's files other than DCP's own are named in one warning and never opened.

Every failure is a :class:`LoadError`: one line naming the file and what is wrong.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from torchtitan.config.errors import UserInputError
from torchtitan.tools.logging import logger
from torchtitan.tools.storage import is_object_store, storage_path

METADATA_FILE = ".metadata"
MANIFEST_FILE = "checkpoint.json"
HF_CONFIG_FILE = "config.json"
_DCP_FILE_RE = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata)$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class LoadError(UserInputError):
    """A checkpoint or weights folder cannot be loaded; the message is one line."""


# ---------------------------------------------------------------------- DCP metadata
_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(
        (module, name)
        for module in ("pathlib", "pathlib._local")
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only its own data classes and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which is not allowed")


def read_dcp_metadata(folder: str | Path, name: str = METADATA_FILE) -> Metadata:
    """The checked DCP metadata of ``folder``."""
    path = _folder_path(folder) / name
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise LoadError(f"{path}: missing (not a DCP checkpoint folder)") from None
    except Exception as e:  # any malformed pickle: truncated, wrong opcodes, refused globals
        raise LoadError(f"{path}: not valid DCP metadata ({_first_line(e)})") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise LoadError(f"{path}: not valid DCP metadata ({problem})")
    return metadata


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _reason(error: BaseException) -> str:
    """One line on why loading failed; for torch's weights-only refusal, the refusal itself
    rather than its advice to load with weights_only=False."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0]
        return f"data that is not plain tensors, refused by the weights-only unpickler: {detail}"
    return _first_line(error)


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(d, int) and d >= 0 for d in value)


def _metadata_problem(metadata: Any) -> str | None:
    """What is malformed in unpickled metadata (every field later code relies on), or None."""
    if type(metadata) is not Metadata:
        return f"it holds a {type(metadata).__name__}, not DCP Metadata"
    if not isinstance(metadata.state_dict_metadata, dict):
        return "state_dict_metadata is not a dict"
    for key, entry in metadata.state_dict_metadata.items():
        problem = _entry_problem(entry)
        if not isinstance(key, str) or problem:
            return f"entry {key!r}: {problem or 'the key is not a string'}"
    if not isinstance(metadata.storage_data, dict):
        return "storage_data is not a dict"
    for index, info in metadata.storage_data.items():
        if type(index) is not MetadataIndex or not isinstance(index.fqn, str):
            return "storage_data has a key that is not a MetadataIndex"
        if type(info) is not _StorageInfo or not isinstance(info.relative_path, str):
            return f"storage_data[{index.fqn!r}] is not a DCP storage record"
        if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)):
            return f"storage_data[{index.fqn!r}] has an invalid offset or length"
        if info.transform_descriptors:
            return (
                f"storage_data[{index.fqn!r}] asks for storage transforms "
                f"{info.transform_descriptors!r}"
            )
    if metadata.storage_meta is not None and type(metadata.storage_meta) is not StorageMeta:
        return "storage_meta is not a StorageMeta"
    return None


def _entry_problem(entry: Any) -> str | None:
    if type(entry) is BytesStorageMetadata:
        return (
            f"a bytes record with crafted attributes {sorted(vars(entry))}" if vars(entry) else None
        )
    if type(entry) is not TensorStorageMetadata:
        return f"a {type(entry).__name__}, not a tensor or bytes record"
    props = entry.properties
    if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype):
        return "tensor record without a dtype"
    if not _is_size(entry.size) or not isinstance(entry.chunks, list):
        return "tensor record without a valid size"
    for chunk in entry.chunks:
        if type(chunk) is not ChunkStorageMetadata or not (
            _is_size(chunk.offsets) and _is_size(chunk.sizes)
        ):
            return "tensor record with an invalid chunk"
    return None


# ---------------------------------------------------------------------- DCP folders
def check_dcp_folder(folder: str | Path, metadata: Metadata) -> None:
    """The folder holds only DCP's files (and ``checkpoint.json``), and every record of the
    metadata points into one of its ``.distcp`` files, within that file's size."""
    folder = _folder_path(folder)
    strays = sorted(
        entry.name
        for entry in folder.iterdir()
        if entry.name not in (MANIFEST_FILE, MANIFEST_FILE + ".tmp")
        and not (_DCP_FILE_RE.match(entry.name) and entry.is_file())
    )
    if strays:
        logger.warning(
            f"{folder}: ignoring {', '.join(strays)} (not files DCP writes; never opened)"
        )
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        if not name.endswith(".distcp") or not _DCP_FILE_RE.match(name):
            raise LoadError(
                f"{folder / METADATA_FILE}: {index.fqn!r} is stored in {name!r}, "
                "which is not a .distcp file of this folder"
            )
        if name not in sizes:
            path = folder / name
            if not path.is_file():
                raise LoadError(f"{path}: missing (the metadata stores {index.fqn!r} there)")
            sizes[name] = path.stat().st_size
        if info.offset + info.length > sizes[name]:
            raise LoadError(
                f"{folder / name}: truncated or corrupt ({sizes[name]} bytes, the metadata "
                f"stores {index.fqn!r} up to byte {info.offset + info.length})"
            )


def check_entries(
    state_dict: dict[str, Any], metadata: Metadata, folder: str | Path, *, hint: str = ""
) -> None:
    """Every entry of ``state_dict`` (nested as DCP flattens it) is stored as what it is: a
    tensor of the same shape and dtype kind, or bytes for a non-tensor value."""
    flat, _ = flatten_state_dict(state_dict)
    stored = metadata.state_dict_metadata
    path = _folder_path(folder) / METADATA_FILE
    missing = sorted(key for key in flat if key not in stored)
    if missing:
        raise LoadError(
            f"{path}: {len(missing)} of the {len(flat)} entries to load are missing (e.g. "
            f"{missing[0]!r}); the checkpoint was saved by another model or configuration{hint}"
        )
    for key, value in flat.items():
        entry = stored[key]
        if not isinstance(value, torch.Tensor):
            if type(entry) is not BytesStorageMetadata:
                raise LoadError(
                    f"{path}: {key!r} should be a plain value but is stored as a tensor"
                )
            continue
        if type(entry) is not TensorStorageMetadata:
            raise LoadError(
                f"{path}: {key!r} is a tensor of the model but is stored as bytes "
                "(refused: bytes are pickled data)"
            )
        if tuple(entry.size) != tuple(value.shape):
            raise LoadError(
                f"{path}: {key!r} has shape {tuple(entry.size)}, the model has "
                f"{tuple(value.shape)}{hint}"
            )
        if not _dtype_fits(entry.properties.dtype, value.dtype):
            raise LoadError(
                f"{path}: {key!r} is stored as {entry.properties.dtype}, the model "
                f"has {value.dtype}{hint}"
            )


def _dtype_fits(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Same dtype, or both floating point (a bf16 export loads into an fp32 model)."""
    return stored == wanted or (stored.is_floating_point and wanted.is_floating_point)


def _folder_path(folder: str | Path) -> Path:
    return storage_path(folder, "checkpoint folder")


class _SafeMetadata:
    """A DCP reader's ``read_metadata`` through the allow-list unpickler and checks."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_dcp_metadata(self.path, name)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """A local folder's reader."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """An fsspec URL's reader (object stores: ranged reads of each record)."""


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (optimizer hyper-parameters) are decoded with ``weights_only=True``;
    the default planner then places the re-encoded, known-safe value."""

    def load_bytes(self, read_item, value) -> None:
        safe = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def load_dcp(
    state_dict: dict[str, Any], folder: str | Path, *, process_group=None, hint: str = ""
) -> None:
    """Load ``state_dict`` in place from the DCP folder ``folder`` (tensors and DTensors are
    resharded, floating dtypes converted), after the checks above. Collective over
    ``process_group`` (default: the world, or none without a process group); every rank
    calls it, and every rank raises the same LoadError when a check fails anywhere."""
    folder = _folder_path(folder)
    distributed = dist.is_available() and dist.is_initialized()
    problem = _local_problem(state_dict, folder, hint)
    if distributed:
        problem = _first_problem_of_all_ranks(problem, process_group)
    if problem:
        raise LoadError(problem)
    reader_type = SafeFsspecReader if is_object_store(folder) else SafeFileSystemReader
    reader, planner = reader_type(str(folder)), WeightsOnlyLoadPlanner()
    try:
        with warnings.catch_warnings():  # one process without a process group is fine here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state_dict,
                storage_reader=reader,
                planner=planner,
                process_group=process_group,
                no_dist=not distributed,
            )
    except CheckpointException as e:
        error, _ = next(iter(e.failures.values()))
        raise LoadError(f"{folder}: cannot be loaded ({_reason(error)})") from None
    except LoadError:
        raise
    except Exception as e:  # weights-only refusals, corrupt tensor data, size mismatches
        raise LoadError(f"{folder}: cannot be loaded ({_reason(e)})") from None


def _local_problem(state_dict: dict[str, Any], folder: Path, hint: str) -> str | None:
    try:
        metadata = read_dcp_metadata(folder)
        check_dcp_folder(folder, metadata)
        check_entries(state_dict, metadata, folder, hint=hint)
    except LoadError as e:
        return str(e)
    except OSError as e:
        return f"{folder}: cannot be read ({_first_line(e)})"
    return None


def _first_problem_of_all_ranks(problem: str | None, group) -> str | None:
    gathered: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, problem, group=group)
    return next((p for p in gathered if p), None)


# ---------------------------------------------------------------------- states over the wire
def load_plain_state(data: bytes, source: str) -> Any:
    """``torch.save`` bytes from ``source`` (a live peer's state for healing), decoded with
    ``weights_only=True``: tensors, containers, numbers and strings only; anything else is a
    LoadError and nothing of it runs."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # the allow-list unpickler's refusals have no common type
        reason = _unpickler_reason(e)
        raise LoadError(f"{source} is not plain tensors and data ({reason})") from None


def _unpickler_reason(error: BaseException) -> str:
    """The allow-list unpickler's own reason (torch wraps it in advice to load unsafely)."""
    for line in str(error).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(".", 1)[0].strip()
    return _first_line(error)


# ---------------------------------------------------------------------- Hugging Face folders
def read_hf_config(
    folder: str | Path, check: Callable[[dict[str, Any]], None]
) -> dict[str, Any] | None:
    """``config.json`` of a Hugging Face folder (None when there is none). ``check`` raises
    ValueError unless a config describes the model being loaded; a config that names remote
    code loads only if it passes, with one warning naming the code it ignores."""
    path = Path(folder) / HF_CONFIG_FILE
    if not path.exists():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LoadError(f"{path}: not a JSON file ({_first_line(e)})") from None
    if not isinstance(config, dict):
        raise LoadError(f"{path}: not a Hugging Face config (a JSON object is expected)")
    if "auto_map" in config or config.get("trust_remote_code"):
        try:
            check(config)
        except ValueError as e:
            raise LoadError(
                f"{path}: names remote code (auto_map), which torchtitan never runs, and {e}"
            ) from None
        side_cars = sorted(
            p.name for p in Path(folder).iterdir() if p.suffix in (".py", *_PICKLE_SUFFIXES)
        )
        beside = f" and {', '.join(side_cars)} beside it" if side_cars else ""
        logger.warning(
            f"{path}: ignoring its remote code (auto_map){beside}: "
            f"{config.get('model_type', 'this architecture')} is built in; nothing of it is "
            "read or imported"
        )
    return config


def safetensors_files(folder: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a Hugging Face folder (pickle-based weights are never
    read)."""
    folder = Path(folder)
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if files:
        return files
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    found = f" ({', '.join(pickled)}: pickle-based, never loaded)" if pickled else ""
    raise LoadError(
        f"{folder}: no *.safetensors files{found}; convert the weights to safetensors first"
    )


@contextmanager
def open_safetensors(path: str | Path) -> Iterator[_CheckedSafetensors]:
    """``safetensors.safe_open`` on the CPU; a file that is not valid safetensors (a
    pickle renamed, truncated data) is a LoadError."""
    with _safetensors_errors(path):
        handle = safe_open(path, framework="pt", device="cpu")
    with handle as f:
        yield _CheckedSafetensors(f, Path(path))


@contextmanager
def _safetensors_errors(path: str | Path) -> Iterator[None]:
    try:
        yield
    except (SafetensorError, OSError, RuntimeError) as e:
        raise LoadError(f"{path}: not a valid safetensors file ({_first_line(e)})") from None


class _CheckedSafetensors:
    """The handle of :func:`open_safetensors`: key names, shapes and tensors."""

    def __init__(self, handle: Any, path: Path) -> None:
        self._handle, self.path = handle, path

    def keys(self) -> list[str]:
        with _safetensors_errors(self.path):
            return list(self._handle.keys())

    def shape(self, key: str) -> list[int]:
        with _safetensors_errors(self.path):
            return self._handle.get_slice(key).get_shape()

    def tensor(self, key: str) -> torch.Tensor:
        with _safetensors_errors(self.path):
            return self._handle.get_tensor(key)
