"""Every key of upstream torchtitan's job config (two TOML generations, upstream_keys.py) is
supported here, an alias of one of our keys, or, for a feature that does not exist here,
accepted at upstream's default and refused with one line naming the key otherwise."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest

from tests.unit_tests.upstream_keys import GENERATIONS, REFUSED_UNLESS_DEFAULT
from torchtitan.config import ConfigError, JobConfig
from torchtitan.config.checks import check_job_config, get_field
from torchtitan.config.parsing import (
    DEPRECATED_ALIASES,
    DEPRECATED_SECTION_ALIASES,
    apply_toml_aliases,
    build_from_dict,
)

# Non-default values where the generic one (the next choice, default + 1, ...) is out of range
# or needs other settings: (value, the other keys it needs).
_PROBES: dict[str, tuple[Any, dict[str, Any]]] = {
    "parallelism.module_fqns_per_model_part": ([["tok_embeddings", "layers.0"]], {}),
    "optimizer.beta1": (0.8, {}),
    "optimizer.beta2": (0.9, {}),
    "training.global_batch_size": (16, {}),
    "parallelism.data_parallel_shard_degree": (2, {}),
    "validation.steps": (5, {}),
    "checkpoint.exclude_from_loading": (["optimizer"], {}),
    "compile.components": (["model"], {}),
    "checkpoint.initial_load_path": ("seed", {"checkpoint.enable": True}),
    "checkpoint.initial_load_in_hf": (True, {"checkpoint.enable": True}),
    "checkpoint.last_save_in_hf": (True, {"checkpoint.enable": True}),
    "fault_tolerance.enable": (True, {"fault_tolerance.group_size": 2}),
    "parallelism.enable_async_tensor_parallel": (True, {"compile.enable": True}),
    "parallelism.expert_tensor_parallel_degree": (2, {"parallelism.tensor_parallel_degree": 2}),
    "training.dataloader.persistent_workers": (True, {"training.dataloader.num_workers": 1}),
    "training.dataloader.prefetch_factor": (2, {"training.dataloader.num_workers": 1}),
}
# Supported keys of which only upstream's default is valid here: the finite validation loader
# reads in the training process (so its worker options stay at their defaults).
_ONLY_DEFAULT_VALID = {
    "validation.dataloader.num_workers",
    "validation.dataloader.persistent_workers",
    "validation.dataloader.prefetch_factor",
}


def _toml_data(settings: dict[str, Any]) -> dict[str, Any]:
    """The TOML tables setting each key (none for None: TOML has no null, unset is the default)."""
    data: dict[str, Any] = {}
    for key, value in settings.items():
        if value is None:
            continue
        *tables, name = key.split(".")
        table = data
        for part in tables:
            table = table.setdefault(part, {})
        table[name] = value
    return data


def _load(key: str, value: Any, companions: dict[str, Any] | None = None) -> Any:
    config = build_from_dict(
        JobConfig, apply_toml_aliases(_toml_data({**(companions or {}), key: value}))
    )
    check_job_config(config)
    return config


def _our_key(key: str) -> str:
    section, _, name = key.rpartition(".")
    section = DEPRECATED_SECTION_ALIASES.get(section, section)
    return ".".join(DEPRECATED_ALIASES.get((section, name), (section, name)))


def _our_field_type(key: str) -> Any:
    owner: Any = JobConfig
    *sections, name = key.split(".")
    for section in sections:
        owner = get_type_hints(owner)[section]
    return get_type_hints(owner)[name]


def _other_value(key: str, default: Any) -> Any:
    """A value of the field other than ``default`` (another choice for a Literal)."""
    if key in _PROBES:
        return _PROBES[key][0]
    field_type = _our_field_type(_our_key(key))
    if default is None:  # an optional field: a value of its type
        field_type = next(t for t in get_args(field_type) if t is not type(None))
        default = {str: "", int: 0, float: 0.0}.get(field_type, field_type)
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
    return [
        pytest.param(key, default, id=f"{generation}:{key}")
        for generation, keys in GENERATIONS.items()
        for key, default in keys.items()
    ]


@pytest.mark.parametrize(("key", "default"), _cases())
def test_upstream_key_loads_at_upstream_default(key: str, default: Any) -> None:
    config = _load(key, default)
    assert get_field(config, _our_key(key)) == default


@pytest.mark.parametrize(("key", "default"), _cases())
def test_upstream_key_other_than_default_is_used_or_refused(key: str, default: Any) -> None:
    """A supported key (or alias) takes another valid value into our field; a key of a
    feature missing here refuses it in one line naming the key."""
    other, companions = _other_value(key, default), _PROBES.get(key, (None, {}))[1]
    if _our_key(key) in REFUSED_UNLESS_DEFAULT | _ONLY_DEFAULT_VALID:
        with pytest.raises(ConfigError, match=re.escape(_our_key(key))) as error:
            _load(key, other, companions)
        assert "\n" not in str(error.value)
    else:
        assert get_field(_load(key, other, companions), _our_key(key)) == other


def test_refused_list_names_only_fields_of_our_config() -> None:
    defaults = JobConfig()
    for key in REFUSED_UNLESS_DEFAULT:
        get_field(defaults, key)


@pytest.mark.parametrize(
    "converter, section", [("mx", "linear"), ("quantize.grouped_mm.mx", "grouped_mm")]
)
def test_upstream_mx_recipe_names_load_but_are_refused_when_mx_is_on(
    converter: str, section: str
) -> None:
    data = {"quantize": {section: {"mx": {"recipe_name": "mxfp8_cublas"}}}}
    check_job_config(build_from_dict(JobConfig, apply_toml_aliases(data)))
    data["model"] = {"converters": [converter]}
    with pytest.raises(
        ConfigError, match=rf"quantize.{section}.mx.recipe_name='mxfp8_cublas': .*mxfp8_rceil"
    ):
        check_job_config(build_from_dict(JobConfig, apply_toml_aliases(data)))
