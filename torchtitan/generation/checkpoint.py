"""Loading model weights for generation from a torch.distributed.checkpoint (DCP) folder.

Accepted, told apart by the keys in the folder's DCP metadata:

- a checkpoint of ``torchtitan/components/checkpoint.py`` (full or model-only): the model
  weights are stored under their plain FQNs, next to ``optimizer.*`` and ``rng.*``;
- a flat model-only export (``dcp.save(model.state_dict())``): plain FQNs only;
- a state dict saved under the key ``"model"`` (``dcp.save({"model": model.state_dict()})``):
  DCP stores ``model.<fqn>``.

Only the model's tensors are read, through the checkpoint module's allow-list metadata reader
(no code runs from the files). A folder without ``.metadata`` is a checkpoint root: its newest
complete ``step-<N>`` is used.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn

from torchtitan.components.checkpoint import (
    SafeFileSystemReader,
    inspect_checkpoint,
    read_dcp_metadata,
    step_folders,
)
from torchtitan.tools.logging import logger

MODEL_KEY = "model"


class CheckpointError(ValueError):
    """The checkpoint folder cannot give this model its weights (one line, names --checkpoint)."""


def resolve_checkpoint_folder(path: str | Path) -> Path:
    folder = Path(path)
    if (folder / ".metadata").is_file():
        return folder
    folders = step_folders(folder)
    for step in sorted(folders, reverse=True):
        manifest, problem = inspect_checkpoint(folders[step])
        if manifest is not None:
            return folders[step]
        logger.warning(f"skipping checkpoint: {problem}")
    raise CheckpointError(
        f"--checkpoint: {str(folder)!r} is not a DCP checkpoint folder (no .metadata) and holds "
        "no complete step-<N> checkpoint"
    )


def load_model_weights(model: nn.Module, path: str | Path) -> Path:
    """Load ``model``'s parameters and persistent buffers in place (DTensors are resharded
    and dtypes converted by DCP); returns the checkpoint folder read."""
    folder = resolve_checkpoint_folder(path)
    try:
        stored = read_dcp_metadata(folder).state_dict_metadata
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as e:
        raise CheckpointError(f"--checkpoint: cannot read the DCP metadata of {folder}: {e}") from None
    state = model.state_dict()
    prefix = _model_prefix(state, stored, folder)
    with warnings.catch_warnings():  # one process without a process group is the normal case here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({prefix + key: value for key, value in state.items()},
                 storage_reader=SafeFileSystemReader(str(folder)))
    return folder


def _model_prefix(state: dict, stored: dict, folder: Path) -> str:
    """'model.' when the state dict was saved under "model", else '' (plain FQNs)."""
    prefix = f"{MODEL_KEY}." if all(f"{MODEL_KEY}.{key}" in stored for key in state) else ""
    missing = sorted(key for key in state if prefix + key not in stored)
    if missing:
        raise CheckpointError(
            f"--checkpoint: {folder} does not hold this model's state dict: {len(missing)} of its "
            f"{len(state)} tensors are missing (e.g. {missing[0]!r}); check model.name / model.flavor"
        )
    for key, value in state.items():
        saved = tuple(getattr(stored[prefix + key], "size", ()))
        if saved != tuple(value.shape):
            raise CheckpointError(
                f"--checkpoint: {folder} holds {key!r} with shape {saved}, the model has "
                f"{tuple(value.shape)}; check model.flavor and the tokenizer (vocabulary size)"
            )
    return prefix
