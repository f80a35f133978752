"""The checkpoint folders on disk: ``{job.dump_folder}/{checkpoint.folder}/step-N``, each
complete once its manifest ``checkpoint.json`` is written (last); which folders are complete,
what is wrong with one that is not, and the atomic publish of a finished save
(``step-N.tmp`` renamed to ``step-N``, the directory synced) and purge of old ones."""

from __future__ import annotations

import json
import os
import re
import shutil
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

if TYPE_CHECKING:
    from torchtitan.config import CheckpointConfig

MANIFEST = MANIFEST_FILE
FORMAT = "torchtitan-dcp-1"

_STEP_RE = re.compile(r"^step-(\d+)$")
_LEFTOVER_RE = re.compile(r"^step-\d+\.(tmp|old)$")


def step_folders(root: Path) -> dict[int, Path]:
    """``step-N`` folders under ``root`` by step; other names are ignored."""
    if not root.is_dir():
        return {}
    found = {}
    for entry in root.iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
    return found


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
    try:
        check_dcp_folder(path, read_dcp_metadata(path))
    except LoadError as e:
        return None, f"corrupt checkpoint: {e}"
    return manifest, None


def complete_checkpoints(root: Path) -> dict[int, dict[str, Any]]:
    """Manifests of the complete checkpoints under ``root`` by step (marker present)."""
    out = {}
    for step, path in step_folders(root).items():
        try:
            out[step] = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
    return out


def complete_steps(root: Path) -> str:
    """The complete checkpoints' steps, for error messages."""
    return ", ".join(str(s) for s in sorted(complete_checkpoints(root))) or "none"


def missing_step_error(root: Path, step: int) -> str:
    return (
        f"checkpoint.load_step={step}: there is no {root / f'step-{step}'} (complete "
        f"checkpoints: {complete_steps(root)}); pick one of those or -1 for the newest"
    )


def not_a_folder_error(path: Path) -> str:
    return f"checkpoint.initial_load_path: {path} is not a checkpoint folder"


def check_checkpoint_inputs(config: CheckpointConfig, dump_folder: str) -> None:
    """Refuse, before any process starts, a ``checkpoint.load_step`` or
    ``checkpoint.initial_load_path`` that names nothing on disk. Loading checks the same
    again, and the contents, on rank 0."""
    root = Path(dump_folder) / config.folder
    if config.create_seed_checkpoint:
        check_seed_folder(root)
        return
    if not config.enable:
        return
    folders = step_folders(root)
    if config.load_step != -1 and config.load_step not in folders:
        raise ConfigError(missing_step_error(root, config.load_step))
    initial = config.initial_load_path
    resumes_from_folders = config.load_step != -1 or folders
    if (
        initial
        and not config.initial_load_in_hf
        and not resumes_from_folders
        and not Path(initial).is_dir()
    ):
        raise ConfigError(not_a_folder_error(Path(initial)))


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
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(step)
    return deleted


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``, replacing an older checkpoint of that step."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(root: Path) -> None:
    """Drop ``step-N.tmp``/``.old`` folders that an interrupted save left behind."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if _LEFTOVER_RE.match(entry.name):
            logger.warning(f"removing {entry}, left by an interrupted checkpoint save")
            shutil.rmtree(entry, ignore_errors=True)


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
