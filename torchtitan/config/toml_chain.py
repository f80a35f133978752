"""Reading a job TOML together with the base configs it names.

A TOML may say ``[job] base_config = "other.toml"`` (a path relative to that file). The base is
read first (recursively: a base may name its own base) and the naming file overrides it key by
key, also inside nested tables. ``base_config`` itself never reaches the JobConfig.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchtitan.config.errors import ConfigError

BASE_CONFIG_KEY = "base_config"


@dataclass
class TomlChain:
    """The merged TOML data and, per dotted key ('training.steps'), the file it came from."""

    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)


def load_toml(path: str, field_name: str = "job.config_file") -> dict[str, Any]:
    """One TOML file; a missing, unreadable or invalid file is a ConfigError on ``field_name``."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{field_name}: no such file: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{field_name}: {path} is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{field_name}: {path} is not valid TOML: {e}") from None


def load_toml_chain(
    path: str, normalize: Callable[[dict[str, Any]], dict[str, Any]] = lambda d: d
) -> TomlChain:
    """``path`` merged over its chain of base configs. ``normalize`` runs on every file's
    data before merging (the deprecated-alias rewrite), so an old key in a base and its new
    name in a child meet as one key."""
    chain = TomlChain()
    for file, data in reversed(_read_chain(path)):
        _merge_into(chain, normalize(data), file, prefix="")
    return chain


def _read_chain(path: str) -> list[tuple[str, dict[str, Any]]]:
    """[(file, data without base_config)] from ``path`` down to the last base."""
    files: list[tuple[str, dict[str, Any]]] = []
    seen: list[str] = []
    current, field_name = path, "job.config_file"
    while current is not None:
        real = os.path.realpath(current)
        if real in seen:
            cycle = " -> ".join(seen[seen.index(real) :] + [real])
            raise ConfigError(f"job.base_config: the base configs form a cycle: {cycle}")
        seen.append(real)
        data = load_toml(current, field_name)
        base = _pop_base_config(data, current)
        files.append((current, data))
        field_name = f"job.base_config (in {current})"
        if base is not None:
            base = os.path.normpath(os.path.join(os.path.dirname(current), base))
        current = base
    return files


def _pop_base_config(data: dict[str, Any], path: str) -> str | None:
    job = data.get("job")
    if not isinstance(job, dict) or BASE_CONFIG_KEY not in job:
        return None
    base = job.pop(BASE_CONFIG_KEY)
    if not isinstance(base, str) or not base:
        raise ConfigError(f"job.base_config (in {path}): expected a TOML file path, got {base!r}")
    return base


def _merge_into(chain: TomlChain, data: dict[str, Any], file: str, prefix: str) -> None:
    target = chain.data
    for part in prefix.split(".") if prefix else []:
        target = target[part]
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(chain, value, file, dotted)
            continue
        target[key] = _copy_tables(value)
        _record_sources(chain.sources, dotted, value, file)


def _copy_tables(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy_tables(v) for k, v in value.items()}
    return value


def _record_sources(sources: dict[str, str], dotted: str, value: Any, file: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _record_sources(sources, f"{dotted}.{key}", item, file)
    else:
        sources[dotted] = file
