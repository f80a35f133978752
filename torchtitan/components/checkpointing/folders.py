"""The checkpoint folders: ``{job.dump_folder}/{checkpoint.folder}/step-N`` (or
``{checkpoint.folder}/step-N`` for a URL, ``storage``), each complete once its manifest
``checkpoint.json`` is written (last); which folders are complete, what is wrong with one that
is not, the publish of a finished save and the purge of old ones. On a local disk a save is
written to ``step-N.tmp`` and renamed (the directory synced); an object store has no rename,
so there a save is written into ``step-N`` and the marker alone publishes it: a ``step-N``
without one is invisible to loading and to ``keep_latest_k`` and is deleted at the next
start."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan.components.checkpointing.safe_loading import (
    MANIFEST_FILE,
    LoadError,
    check_dcp_folder,
    read_dcp_metadata,
)
from torchtitan.config import ConfigError
from torchtitan.tools.logging import logger
from torchtitan.tools.storage import (
    check_reachable,
    checkpoint_root,
    is_object_store,
    remove_tree,
    storage_path,
    write_json,
)

if TYPE_CHECKING:
    from torchtitan.config import CheckpointConfig

MANIFEST = MANIFEST_FILE
FORMAT = "torchtitan-dcp-1"

_STEP_RE = re.compile(r"^step-(\d+)$")
_LEFTOVER_RE = re.compile(r"^step-\d+\.(tmp|old)$")


def refresh_listing(folder: Path) -> None:
    """Forget the filesystem's cached listing of ``folder`` (object stores cache listings;
    other processes write there)."""
    if is_object_store(folder):
        folder.fs.invalidate_cache(folder.path)


def step_folders(root: Path) -> dict[int, Path]:
    """``step-N`` folders under ``root`` by step; other names are ignored."""
    refresh_listing(root)
    if not root.is_dir():
        return {}
    found = {}
    for entry in root.iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir() and _holds_files(entry):
            found[int(match.group(1))] = entry
    return found


def _holds_files(folder: Path) -> bool:
    """An object store may list a prefix emptied a moment ago (SeaweedFS drops empty
    directories lazily); such a folder is nothing."""
    return not is_object_store(folder) or any(True for _ in folder.iterdir())


def inspect_checkpoint(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) for a complete checkpoint, else (None, what is wrong with it)."""
    marker = path / MANIFEST
    if not marker.is_file():
        return None, f"{path} is incomplete (no {MANIFEST}: its save did not finish)"
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return None, f"{path} is corrupt ({MANIFEST} is unreadable: {e})"
    for name, size in files.items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            return None, f"{path} is corrupt ({name}: {found}, expected {size} bytes)"
    for name, tag in manifest.get("etags", {}).items():
        if content_tag(path / name) != tag:
            return None, f"{path} is corrupt ({name} was replaced: its ETag is not the saved one)"
    try:
        check_dcp_folder(path, read_dcp_metadata(path))
    except LoadError as e:
        return None, f"corrupt checkpoint: {e}"
    return manifest, None


def content_tag(file: Path) -> str | None:
    """An object store's hash of ``file``'s content (S3's ETag: the MD5 of a single-part
    upload, of its parts' MD5s for a multipart one), from the listing, without reading it."""
    return file.fs.info(file.path).get("ETag")


def complete_checkpoints(root: Path) -> dict[int, dict[str, Any]]:
    """Manifests of the complete checkpoints under ``root`` by step (marker present)."""
    out = {}
    for step, path in step_folders(root).items():
        try:
            out[step] = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
    return out


def saved_run_seed(root: Path, step: int) -> int | None:
    """The run seed kept in the checkpoint a resume of this run loads (``step``, -1: the
    newest full one): a run given no debug.seed reuses it, so that what the seed alone
    decides (a DPO reference or LoRA base initialised without initial weights, GRPO's
    rollouts) is what it was before the stop. None where no checkpoint holds one."""
    manifests = complete_checkpoints(root)
    if step != -1:
        candidates = [manifests[step]] if step in manifests else []
    else:
        candidates = [manifests[s] for s in sorted(manifests, reverse=True)]
    for manifest in candidates:
        if manifest.get("model_only"):
            continue
        seed = manifest.get("states", {}).get("train_state", {}).get("seed")
        if seed is not None:
            return int(seed)
    return None


def complete_steps(root: Path) -> str:
    """The complete checkpoints' steps, for error messages."""
    return ", ".join(str(s) for s in sorted(complete_checkpoints(root))) or "none"


def missing_step_error(root: Path, step: int) -> str:
    return (
        f"checkpoint.load_step={step}: there is no {root / f'step-{step}'} (complete "
        f"checkpoints: {complete_steps(root)}); pick one of those or -1 for the newest"
    )


def not_a_folder_error(path: Path | str) -> str:
    return f"checkpoint.initial_load_path: {path} is not a checkpoint folder"


def check_checkpoint_inputs(config: CheckpointConfig, dump_folder: str) -> None:
    """Refuse, before any process starts, a checkpoint storage that cannot be reached, a
    ``checkpoint.load_step`` or ``checkpoint.initial_load_path`` that names nothing there.
    Loading checks the same again, and the contents,
    on rank 0."""
    if not (config.enable or config.create_seed_checkpoint):
        return
    root = checkpoint_root(config.folder, dump_folder)
    check_reachable(root, "checkpoint.folder")
    if config.create_seed_checkpoint:
        check_seed_folder(root)
        return
    folders = step_folders(root)
    if config.load_step != -1 and config.load_step not in folders:
        raise ConfigError(missing_step_error(root, config.load_step))
    if not config.initial_load_path:
        return
    initial = storage_path(config.initial_load_path, "checkpoint.initial_load_path")
    check_reachable(initial, "checkpoint.initial_load_path")
    resumes_from_folders = config.load_step != -1 or folders
    if not config.initial_load_in_hf and not resumes_from_folders and not initial.is_dir():
        raise ConfigError(not_a_folder_error(initial))


def check_seed_folder(root: Path) -> None:
    """A seed checkpoint goes into a folder without later checkpoints, which a run would
    load instead of the seed."""
    existing = sorted(s for s in complete_checkpoints(root) if s != 0)
    if existing:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint: {root} already holds checkpoints "
            f"(step-{existing[-1]}), which a later run would load instead of the seed; "
            "use an empty checkpoint.folder"
        )


def purge_old_checkpoints(root: Path, keep: int) -> list[int]:
    """Delete all but the ``keep`` newest complete checkpoints; return the deleted steps.

    Only complete ``step-N`` folders count and are deleted (marker first, so an interrupted
    delete leaves an incomplete folder that loading skips); other entries are left alone.
    """
    if keep <= 0:
        return []
    steps = sorted(complete_checkpoints(root), reverse=True)
    deleted = []
    for step in steps[keep:]:
        path = root / f"step-{step}"
        (path / MANIFEST).unlink(missing_ok=True)
        remove_tree(path)
        deleted.append(step)
    return deleted


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_folder(root: Path, step: int) -> Path:
    """Where the save of ``step`` writes: ``step-N.tmp`` on a local disk, ``step-N`` itself
    on an object store."""
    return root / (f"step-{step}" if is_object_store(root) else f"step-{step}.tmp")


def publish(written: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the marker (``manifest`` with the size of every file written, and on an object
    store its ETag, the store's hash of the content) into the finished ``written`` folder
    and publish it as ``final``: on a local disk by renaming it over an older checkpoint of
    that step; on an object store ``written`` is ``final`` and the marker is the publish."""
    refresh_listing(written)
    files = [f for f in written.iterdir() if f.is_file()]
    manifest["files"] = {f.name: f.stat().st_size for f in files}
    if is_object_store(written):
        manifest["etags"] = {f.name: content_tag(f) for f in files}
    write_json(written / MANIFEST, manifest)
    if written == final:
        return
    old = final.with_name(final.name + ".old")
    if final.exists():
        remove_tree(old)
        final.rename(old)
    written.rename(final)
    _fsync_dir(final.parent)
    remove_tree(old)


def remove_leftovers(root: Path) -> None:
    """Drop what interrupted saves left behind: ``step-N.tmp``/``.old`` folders on a local
    disk, ``step-N`` folders without a marker on an object store."""
    if is_object_store(root):
        leftovers = [f for f in step_folders(root).values() if not (f / MANIFEST).is_file()]
    elif root.is_dir():
        leftovers = [entry for entry in root.iterdir() if _LEFTOVER_RE.match(entry.name)]
    else:
        leftovers = []
    for entry in leftovers:
        logger.warning(f"removing {entry}, left by an interrupted checkpoint save")
        remove_tree(entry)


def plain_json(states: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``states`` through JSON; a state that is not plain data is an error."""
    out = {}
    for key, value in states.items():
        try:
            out[key] = json.loads(json.dumps(value))
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"checkpoint: the state {key!r} is not plain JSON data ({e}); its state_dict() "
                "must return only dicts, lists, strings, numbers, booleans and None"
            ) from None
    return out
