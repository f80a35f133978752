"""Which checkpoint a run loads (decided on rank 0, broadcast to every rank): an explicit
``checkpoint.load_step``, else the newest complete full checkpoint, else the newest
model-only one, else the configured initial weights (a DCP folder or Hugging Face
safetensors). A choice that cannot load carries the one-line error every rank raises."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan.components.checkpointing.folders import (
    MANIFEST,
    complete_steps,
    inspect_checkpoint,
    missing_step_error,
    not_a_folder_error,
    step_folders,
)
from torchtitan.tools.logging import logger
from torchtitan.tools.storage import storage_path

if TYPE_CHECKING:
    from torchtitan.config import CheckpointConfig


@dataclass
class LoadChoice:
    """What rank 0 decided to load (broadcast to every rank)."""

    path: str | None = None
    manifest: dict[str, Any] | None = None  # None: a plain DCP folder (initial_load_path)
    model_only: bool = False
    error: str | None = None
    hf: bool = False  # a folder of Hugging Face safetensors
    base: bool = False  # the configured initial weights (not a checkpoint of this run)


def choose_checkpoint(
    root: Path, step: int, config: CheckpointConfig, hf_assets_path: str | None
) -> LoadChoice:
    """Rank 0: which checkpoint under ``root`` to load for ``step`` (-1: the newest), or
    the error to raise on every rank."""
    folders = step_folders(root)
    if step != -1:
        return _choose_explicit(root, step, folders)
    model_only_choice = None
    for candidate in sorted(folders, reverse=True):
        manifest, problem = inspect_checkpoint(folders[candidate])
        if manifest is None:
            logger.warning(f"skipping checkpoint: {problem}; falling back to an older one")
        elif not manifest["model_only"]:
            return LoadChoice(str(folders[candidate]), manifest, False)
        elif model_only_choice is None:  # an export or a seed: weights only
            model_only_choice = LoadChoice(str(folders[candidate]), manifest, True)
    if model_only_choice is not None:
        return model_only_choice
    return choose_initial_weights(config, hf_assets_path)


def choose_initial_weights(config: CheckpointConfig, hf_assets_path: str | None) -> LoadChoice:
    """The configured initial weights (not a checkpoint of this run); no path: nothing."""
    if config.initial_load_in_hf:
        choice = _choose_hf(config, hf_assets_path)
    elif config.initial_load_path:
        path = storage_path(config.initial_load_path, "checkpoint.initial_load_path")
        choice = _choose_initial(path, config.initial_load_model_only)
    else:
        return LoadChoice()
    choice.base = True
    return choice


def _choose_explicit(root: Path, step: int, folders: dict[int, Path]) -> LoadChoice:
    if step not in folders:
        return LoadChoice(error=missing_step_error(root, step))
    manifest, problem = inspect_checkpoint(folders[step])
    if manifest is None:
        return LoadChoice(
            error=(
                f"checkpoint.load_step={step}: {problem}; pick another step (complete: "
                f"{complete_steps(root)}) or -1 for the newest complete checkpoint"
            )
        )
    return LoadChoice(str(folders[step]), manifest, manifest["model_only"])


def _choose_hf(config: CheckpointConfig, hf_assets_path: str | None) -> LoadChoice:
    path = config.initial_load_path or hf_assets_path
    if not path:
        return LoadChoice(
            error=(
                "checkpoint.initial_load_in_hf: set checkpoint.initial_load_path (or "
                "model.hf_assets_path) to a folder of Hugging Face safetensors"
            )
        )
    return LoadChoice(str(path), None, True, hf=True)


def _choose_initial(path: Path, model_only: bool) -> LoadChoice:
    field = "checkpoint.initial_load_path"
    if not path.is_dir():
        return LoadChoice(error=not_a_folder_error(path))
    if not (path / MANIFEST).exists():
        if not (path / ".metadata").is_file():
            return LoadChoice(error=f"{field}: {path} holds no DCP checkpoint (no .metadata)")
        if not model_only:
            return LoadChoice(
                error=(
                    f"{field}: {path} is a plain DCP checkpoint (no {MANIFEST}); "
                    "only its model weights can load: set checkpoint.initial_load_model_only"
                )
            )
        return LoadChoice(str(path), None, True)
    manifest, problem = inspect_checkpoint(path)
    if manifest is None:
        return LoadChoice(error=f"{field}: {problem}")
    if manifest["model_only"] and not model_only:
        return LoadChoice(
            error=(
                f"{field}: {path} holds model weights only; set checkpoint.initial_load_model_only"
            )
        )
    return LoadChoice(str(path), manifest, model_only)
