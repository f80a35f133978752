"""Model converters: transformations applied to the meta-device model before
parallelisation (e.g. float8 linears), in the order given by ``model.converters``.

A converter is registered by name with the job-config section it reads (a dotted path such
as ``quantize.linear.float8``); it is built with that section only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from torchtitan.config.checks import get_field
from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims


class ModelConverter(Protocol):
    def __init__(self, settings: Any, parallel_dims: ParallelDims | None) -> None:
        """``settings``: the config section named at registration (None if none was)."""

    def convert(self, model: nn.Module) -> None:
        """Modify ``model`` in place."""

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        """Run after every optimizer step (e.g. to refresh scales)."""


@dataclass(frozen=True)
class _Registration:
    converter_cls: type[ModelConverter]
    config_section: str | None


_converters: dict[str, _Registration] = {}


def register_model_converter(
    converter_cls: type[ModelConverter], name: str, config_section: str | None = None
) -> None:
    """Make ``name`` valid in ``model.converters``; ``config_section`` (e.g.
    ``"quantize.linear.float8"``) is the job-config section its ``__init__`` receives."""
    if name in _converters:
        raise ValueError(f"a model converter named {name!r} is already registered")
    _converters[name] = _Registration(converter_cls, config_section)


def check_converter_names(names: list[str]) -> None:
    """Raise ConfigError naming ``model.converters`` if a name is not registered."""
    unknown = [n for n in names if n not in _converters]
    if unknown:
        known = ", ".join(sorted(_converters)) or "none registered"
        raise ConfigError(f"model.converters: unknown converter(s) {unknown}; registered: {known}")


class ModelConvertersContainer:
    """Builds the converters named in ``model.converters``, each from its own config section,
    and applies them in order."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims | None) -> None:
        names = job_config.model.converters
        check_converter_names(names)
        self.converters = []
        for name in names:
            registration = _converters[name]
            section = registration.config_section
            settings = None if section is None else get_field(job_config, section)
            self.converters.append(registration.converter_cls(settings, parallel_dims))

    def convert(self, model: nn.Module) -> None:
        for converter in self.converters:
            converter.convert(model)

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        for converter in self.converters:
            converter.post_optimizer_hook(model_parts)
