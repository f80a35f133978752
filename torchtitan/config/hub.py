"""A Hugging Face model id in ``model.hf_assets_path`` (``org/name`` that is not a folder
here): the snapshot folder in the Hugging Face cache, fetched when online (huggingface_hub's
``snapshot_download``, which also answers from the cache offline)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
ASSETS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "*.safetensors",
    "model.safetensors.index.json",
]
"""What a run reads from a model folder (never code: remote code is not run)."""


def resolve_hf_assets_path(model: Any) -> None:
    """Replace a hub id in ``model.hf_assets_path`` by its snapshot folder (one line naming
    the field when it can be neither found nor fetched)."""
    path = model.hf_assets_path
    if not path or Path(path).exists() or not HUB_ID.fullmatch(path):
        return
    from huggingface_hub import snapshot_download

    try:
        model.hf_assets_path = snapshot_download(path, allow_patterns=ASSETS)
    except Exception as e:  # offline, gated, absent: the library's many error types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(
            f"model.hf_assets_path: {path!r} is not a folder here, and as a Hugging Face model "
            f"id it cannot be fetched ({type(e).__name__}: {reason}); log in or go online, "
            "or point at a local folder"
        ) from None
