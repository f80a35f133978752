"""The oldest torch this code runs on, checked at the start of every entry point (read from
the installed package's metadata, so the check does not import torch)."""

from __future__ import annotations

import importlib.metadata
import re

from torchtitan.config.errors import ConfigError

MIN_TORCH_VERSION = (2, 11)


def _major_minor(version: str) -> tuple[int, int] | None:
    """(2, 11) for '2.11.0', '2.11.0a0+git1234' (a 2.11 pre-release) or '2.11.0+cu128'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_torch_version(version: str | None = None) -> None:
    """ConfigError (one line) if the installed torch (or ``version``) is older than
    MIN_TORCH_VERSION."""
    needed = ".".join(map(str, MIN_TORCH_VERSION))
    if version is None:
        try:
            version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(
                f"torch is not installed; this code needs torch >= {needed}"
            ) from None
    found = _major_minor(version)
    if found is not None and found < MIN_TORCH_VERSION:
        raise ConfigError(
            f"torch {version} is installed but this code needs torch >= {needed}; "
            f"upgrade it (pip install 'torch>={needed}')"
        )
