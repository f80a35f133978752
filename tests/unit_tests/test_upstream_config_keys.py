"""Every key of upstream torchtitan's job config (two TOML generations, upstream_keys.py) is
supported here, an alias of one of our keys, or, for a feature that does not exist here,
accepted at upstream's default and refused with one line naming the key otherwise."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest

from tests.unit_tests.upstream_keys import GENERATIONS, OWNED_BY_FLOAT8_CONVERTER, REFUSED_UNLESS_DEFAULT
from torchtitan.config import ConfigError, JobConfig
from torchtitan.config.manager import DEPRECATED_ALIASES, apply_toml_aliases, build_from_dict
from torchtitan.config.validation import get_field, validate_job_config

# Non-default values for the refused keys whose default is None.
_PROBES: dict[str, Any] = {"parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.0"]]}


def _toml_data(key: str, value: Any) -> dict[str, Any]:
    """The TOML tables setting ``key`` (none for None: TOML has no null, unset is the default)."""
    if value is None:
        return {}
    *tables, name = key.split(".")
    data: dict[str, Any] = {name: value}
    for table in reversed(tables):
        data = {table: data}
    return data


def _load(key: str, value: Any) -> Any:
    config = build_from_dict(JobConfig, apply_toml_aliases(_toml_data(key, value)))
    validate_job_config(config)
    return config


def _our_key(key: str) -> str:
    section, _, name = key.rpartition(".")
    return ".".join(DEPRECATED_ALIASES.get((section, name), (section, name)))


def _our_field_type(key: str) -> Any:
    owner: Any = JobConfig
    *sections, name = key.split(".")
    for section in sections:
        owner = get_type_hints(owner)[section]
    return get_type_hints(owner)[name]


def _other_value(key: str, default: Any) -> Any:
    """A valid value of the field other than ``default`` (another choice for a Literal)."""
    if key in _PROBES:
        return _PROBES[key]
    field_type = _our_field_type(_our_key(key))
    if get_origin(field_type) is Literal:
        return next(choice for choice in get_args(field_type) if choice != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "_other"
    return [*default, "other"]


def _cases() -> list[Any]:
    return [pytest.param(key, default, id=f"{generation}:{key}")
            for generation, keys in GENERATIONS.items() for key, default in keys.items()]


@pytest.mark.parametrize(("key", "default"), _cases())
def test_upstream_key_loads_at_upstream_default(key: str, default: Any) -> None:
    if key in OWNED_BY_FLOAT8_CONVERTER:
        pytest.skip("float8 sections land with the float8 converter (#21)")
    config = _load(key, default)
    assert get_field(config, _our_key(key)) == default


@pytest.mark.parametrize(("key", "default"), _cases())
def test_upstream_feature_missing_here_is_refused_unless_default(key: str, default: Any) -> None:
    if key in OWNED_BY_FLOAT8_CONVERTER:
        pytest.skip("float8 sections land with the float8 converter (#21)")
    if _our_key(key) not in REFUSED_UNLESS_DEFAULT:
        return
    with pytest.raises(ConfigError, match=re.escape(_our_key(key))) as error:
        _load(key, _other_value(key, default))
    assert "\n" not in str(error.value)


def test_refused_list_names_only_fields_of_our_config() -> None:
    defaults = JobConfig()
    for key in REFUSED_UNLESS_DEFAULT:
        get_field(defaults, key)
