"""How a merged job config is checked. Every section of job_config.py checks its own fields in
its ``check`` method, beside them, with the rules defined here; ``check_job_config`` runs those
in the order of JobConfig's sections, then the checks that read several sections
(across_sections.py). The first invalid value is refused with one line naming its field."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from torchtitan.config.across_sections import check_across_sections
from torchtitan.config.errors import ConfigError


class Rule(NamedTuple):
    """What a field's value must satisfy, and the message that says so."""

    holds: Callable[[Any], bool]
    says: str


AT_LEAST_0 = Rule(lambda v: v >= 0, "must be >= 0")
AT_LEAST_1 = Rule(lambda v: v >= 1, "must be >= 1")
POSITIVE = Rule(lambda v: v > 0, "must be > 0")
IN_0_1_OPEN = Rule(lambda v: 0 <= v < 1, "must be in [0, 1)")
IN_0_1 = Rule(lambda v: 0 <= v <= 1, "must be in [0, 1]")


def unset_or(rule: Rule, says: str | None = None) -> Rule:
    """``rule`` for a field that may also be None (unset); ``says`` replaces its message."""
    return Rule(lambda v: v is None or rule.holds(v), says or rule.says)


def check_values(section: Any, path: str, **rules: Rule) -> None:
    """Refuse the first field, in the order given, whose value breaks its rule: ``path`` is
    where ``section`` sits in the config (``training``, ``training.dataloader``, ...)."""
    for name, rule in rules.items():
        value = getattr(section, name)
        if not rule.holds(value):
            raise ConfigError(f"{path}.{name}: {rule.says}, got {value!r}")


def refuse_until_supported(section: Any, path: str, **features: str) -> None:
    """Switches of features whose issue has not landed: turned on, they are refused, never
    accepted and silently ignored. The issue that builds a feature removes its switch here."""
    for name, feature in features.items():
        value = getattr(section, name)
        if value:
            raise ConfigError(
                f"{path}.{name}={value!r}: {feature} is not supported yet in this version; "
                "leave it at its default"
            )


def refuse_upstream_only(section: Any, path: str, **features: str) -> None:
    """Upstream settings of features this code base does not have: accepted at upstream's
    default (so upstream TOMLs load), refused otherwise."""
    defaults = type(section)()
    for name, feature in features.items():
        value, default = getattr(section, name), getattr(defaults, name)
        if value != default:
            raise ConfigError(
                f"{path}.{name}={value!r}: this version has no {feature}; remove the key or "
                f"leave it at {default!r}"
            )


def check_ac_config(mode: str, selective_option: str) -> str | None:
    """An error message for an invalid selective activation-checkpointing option, else None."""
    if mode != "selective" or selective_option == "op":
        return None
    if not selective_option.isdigit() or int(selective_option) < 1:
        return (
            f"activation_checkpoint.selective_ac_option: must be a positive integer N (every "
            f"N-th block) or 'op', got {selective_option!r}"
        )
    return None


def get_field(config: Any, path: str) -> Any:
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def check_job_config(config: Any) -> None:
    """Raise ConfigError (one line naming the field) for the first invalid value: each
    section's own checks, in the order of the config's sections, then those across sections."""
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if hasattr(value, "check"):  # a section of a custom_config_module may have none
            value.check(section.name)
    check_across_sections(config)
