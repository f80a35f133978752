"""Loading model weights for generation from a torch.distributed.checkpoint (DCP) folder.

Accepted, told apart by the keys in the folder's DCP metadata:

- a checkpoint of ``torchtitan/components/checkpointing/`` (full or model-only): the model
  weights are stored under their plain FQNs, next to ``optimizer.*`` and ``rng.*``;
- a flat model-only export (``dcp.save(model.state_dict())``): plain FQNs only;
- a state dict saved under the key ``"model"`` (``dcp.save({"model": model.state_dict()})``):
  DCP stores ``model.<fqn>``.

Only the model's tensors are read, through ``components/safe_loading`` (no code runs from
the files; every tensor is checked against the metadata first). A folder without
``.metadata`` is a checkpoint root: its newest complete ``step-<N>`` is used.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from torchtitan.components.checkpointing.folders import inspect_checkpoint, step_folders
from torchtitan.components.checkpointing.safe_loading import (
    METADATA_FILE,
    LoadError,
    load_dcp,
    read_dcp_metadata,
)
from torchtitan.config.errors import UserInputError
from torchtitan.tools.logging import logger

MODEL_KEY = "model"


class CheckpointError(UserInputError):
    """The checkpoint folder cannot give this model its weights (one line, names --checkpoint)."""


def resolve_checkpoint_folder(path: str | Path) -> Path:
    folder = Path(path)
    if (folder / METADATA_FILE).is_file():
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
        state = model.state_dict()
        prefix = f"{MODEL_KEY}." if all(f"{MODEL_KEY}.{key}" in stored for key in state) else ""
        load_dcp(
            {prefix + key: value for key, value in state.items()},
            folder,
            hint="; check model.name, model.flavor and the tokenizer (vocabulary size)",
        )
    except LoadError as e:
        raise CheckpointError(f"--checkpoint: {e}") from None
    return folder
