"""The checkpoint storage seam on fsspec's in-memory filesystem (an object store without
rename): a step is published by its marker alone, a step without one is invisible and purged
at the next start, keep_latest_k counts committed steps only; URLs and their one-line
errors."""

from __future__ import annotations

import importlib
import sys
import uuid
from pathlib import Path

import pytest

from torchtitan.components.checkpointing.folders import (
    MANIFEST,
    complete_checkpoints,
    publish,
    purge_old_checkpoints,
    remove_leftovers,
    save_folder,
    step_folders,
)
from torchtitan.config import ConfigError
from torchtitan.tools.storage import checkpoint_root, is_object_store, storage_path


@pytest.fixture
def root():
    """A fresh ``memory://`` checkpoint root (the filesystem is per process)."""
    path = storage_path(f"memory://titan-{uuid.uuid4().hex}/checkpoint", "checkpoint.folder")
    yield path
    if path.exists():
        path.fs.rm(path.path, recursive=True)


def _write_step(root, step: int, committed: bool = True) -> None:
    folder = save_folder(root, step)
    (folder / "__0_0.distcp").write_bytes(b"x" * (10 + step))
    if committed:
        publish(folder, root / f"step-{step}", {"step": step, "model_only": False})


def test_an_object_store_step_is_written_in_place_and_published_by_its_marker(root):
    assert is_object_store(root)
    assert save_folder(root, 3) == root / "step-3"  # no rename there
    _write_step(root, 3)
    manifests = complete_checkpoints(root)
    assert list(manifests) == [3]
    assert manifests[3]["files"] == {"__0_0.distcp": 13}


def test_a_step_without_its_marker_is_invisible_and_purged_at_the_next_start(root):
    _write_step(root, 2)
    _write_step(root, 4, committed=False)  # a save killed before its marker
    assert sorted(step_folders(root)) == [2, 4]
    assert list(complete_checkpoints(root)) == [2]
    remove_leftovers(root)
    assert sorted(step_folders(root)) == [2]
    assert (root / "step-2" / MANIFEST).is_file()


def test_keep_latest_k_counts_and_deletes_committed_steps_only(root):
    for step in (1, 2, 3):
        _write_step(root, step)
    _write_step(root, 4, committed=False)
    assert purge_old_checkpoints(root, keep=2) == [1]
    assert sorted(step_folders(root)) == [2, 3, 4]


def test_local_folders_keep_the_rename_publish(tmp_path):
    root = checkpoint_root("checkpoint", str(tmp_path))
    assert root == tmp_path / "checkpoint" and not is_object_store(root)
    assert save_folder(root, 5) == root / "step-5.tmp"
    assert storage_path("file:///data/run", "checkpoint.folder") == Path("/data/run")


def test_a_url_folder_is_not_under_the_dump_folder():
    root = checkpoint_root("memory://bucket/run", "./outputs")
    assert str(root) == "memory://bucket/run"


def test_an_unknown_scheme_is_one_line():
    with pytest.raises(ConfigError, match=r"^checkpoint.folder: unknown storage scheme nosuch://"):
        storage_path("nosuch://bucket/run", "checkpoint.folder")


def test_a_missing_filesystem_package_names_it(monkeypatch):
    # the filesystem classes fsspec imported already, and the package, gone
    monkeypatch.delitem(importlib.import_module("fsspec.registry")._registry, "s3", raising=False)
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(ConfigError, match=r"s3:// needs s3fs, which is not installed; pip "):
        storage_path("s3://bucket/run", "checkpoint.folder")
