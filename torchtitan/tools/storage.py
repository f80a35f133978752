"""Where checkpoints live: a local folder, or the URL of an fsspec filesystem (``s3://``,
``gs://``, ``memory://``; ``file://`` is a local folder) as a pathlib-like path
(universal_pathlib's ``UPath``). Object stores have no rename: a step there is written in
place and published by its marker, written last (``folders``). Credentials come from each
provider's standard environment and files (s3fs: ``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``,
``~/.aws``); transient errors are retried by the provider's client (botocore's retry modes);
messages name the URL, never a credential."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchtitan.config import ConfigError
from torchtitan.config.errors import UserInputError

LOCAL_SCHEMES = ("file", "local")
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
"""The package each object-store scheme needs (the ``s3``/``gcs`` extras install them)."""


class StorageError(UserInputError):
    """Storage that failed after its client's retries (an outage, lost credentials, a full
    disk): one line naming the folder; what was committed before stays loadable."""


def first_line(error: BaseException) -> str:
    """The first line of ``error`` (of the first failure a DCP ``CheckpointException``
    carries), prefixed by its type, at most 200 characters."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    return f"{type(error).__name__}: {_first_line(error)}"


def is_url(location: str) -> bool:
    return "://" in location


def storage_path(location: str | Path, field: str) -> Path:
    """``location`` as a path: a ``pathlib.Path`` for a local folder (``file://`` included),
    else a ``UPath`` of its filesystem; an unknown scheme or a missing filesystem package is
    one line naming ``field``."""
    if not isinstance(location, str):
        return location  # already a path (local or not)
    if not is_url(location):
        return Path(location)
    scheme, rest = location.split("://", 1)
    if scheme in LOCAL_SCHEMES:
        return Path(rest)
    import fsspec

    if scheme not in fsspec.available_protocols():
        raise ConfigError(
            f"{field}: unknown storage scheme {scheme}:// in {location}; use a local folder or "
            "s3://, gs://, memory://, file://"
        )
    from upath import UPath

    path = UPath(location)
    try:
        path.fs  # noqa: B018 (the filesystem's package is imported here, not at first use)
        return path
    except ImportError:
        package = PACKAGES.get(scheme, f"fsspec's {scheme} filesystem")
        raise ConfigError(
            f"{field}: {scheme}:// needs {package}, which is not installed; pip install {package}"
        ) from None


def is_object_store(path: Path) -> bool:
    """Whether ``path`` lives on a filesystem without an atomic rename (not a local folder)."""
    return not isinstance(path, Path)


def checkpoint_root(folder: str, dump_folder: str) -> Path:
    """``checkpoint.folder``: a URL as it is, a local folder under ``job.dump_folder``."""
    if is_url(folder):
        return storage_path(folder, "checkpoint.folder")
    return Path(dump_folder) / folder


def check_reachable(path: Path, field: str) -> None:
    """One line naming ``field`` where ``path``'s bucket does not exist or cannot be read
    with the credentials at hand (nothing is written)."""
    if not is_object_store(path) or path.protocol == "memory":
        return
    bucket = path.path.split("/", 1)[0]
    try:
        path.fs.ls(bucket, refresh=True)
    except FileNotFoundError:
        raise ConfigError(
            f"{field}: the bucket {bucket!r} of {path} does not exist; create it or fix the URL"
        ) from None
    except PermissionError as e:
        raise ConfigError(
            f"{field}: {path} refused these credentials ({_first_line(e)}); check the "
            "provider's environment variables or credentials file"
        ) from None
    except Exception as e:  # no credentials at all, an unreachable endpoint
        raise ConfigError(
            f"{field}: cannot reach {path} ({type(e).__name__}: {_first_line(e)})"
        ) from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def remove_tree(path: Path) -> None:
    """Delete ``path`` and everything under it; nothing there is fine."""
    if not is_object_store(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        path.fs.rm(path.path, recursive=True)
    except FileNotFoundError:
        pass


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON at ``path``, whole or not at all: locally through a synced temporary
    file and a rename; on an object store one PUT (an object appears whole or not at all)."""
    if is_object_store(path):
        path.write_text(json.dumps(data))
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def writing_into(dest: Path, last: str | None = None) -> Iterator[Path]:
    """A local folder to write ``dest``'s files into (for writers of local files, such as
    safetensors): ``dest`` itself on a local disk; for an object store a temporary folder
    whose files are uploaded into ``dest`` when the block ends without an error, the file
    named ``last`` (a completion marker) after all others."""
    if not is_object_store(dest):
        yield dest
        return
    with tempfile.TemporaryDirectory(prefix="torchtitan-upload-") as tmp:
        yield Path(tmp)
        for file in sorted(Path(tmp).iterdir(), key=lambda f: f.name == last):
            dest.fs.put_file(str(file), (dest / file.name).path)


@contextlib.contextmanager
def reading_from(source: Path) -> Iterator[Path]:
    """A local folder with ``source``'s files (for readers of local files): ``source``
    itself on a local disk; for an object store a temporary download of its files (this
    process's own, deleted when the block ends)."""
    if not is_object_store(source):
        yield source
        return
    with tempfile.TemporaryDirectory(prefix="torchtitan-download-") as tmp:
        for file in source.iterdir():
            if file.is_file():
                source.fs.get_file(file.path, os.path.join(tmp, file.name))
        yield Path(tmp)
