"""Model converters: transformations applied to the meta-device model before
parallelisation (e.g. float8 linears), in the order given by ``model.converters``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch import nn

from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims


class ModelConverter(Protocol):
    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None: ...

    def convert(self, model: nn.Module) -> None:
        """Modify ``model`` in place."""

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        """Run after every optimizer step (e.g. to refresh scales)."""


_converter_classes: dict[str, type[ModelConverter]] = {}


def register_model_converter(converter_cls: type[ModelConverter], name: str) -> None:
    if name in _converter_classes:
        raise ValueError(f"a model converter named {name!r} is already registered")
    _converter_classes[name] = converter_cls


def check_converter_names(names: list[str]) -> None:
    """Raise ConfigError naming ``model.converters`` if a name is not registered."""
    unknown = [n for n in names if n not in _converter_classes]
    if unknown:
        known = ", ".join(sorted(_converter_classes)) or "none registered"
        raise ConfigError(f"model.converters: unknown converter(s) {unknown}; registered: {known}")


class ModelConvertersContainer:
    """Applies the converters named in ``model.converters``, in order."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        check_converter_names(job_config.model.converters)
        self.converters = [
            _converter_classes[name](job_config, parallel_dims)
            for name in job_config.model.converters
        ]

    def convert(self, model: nn.Module) -> None:
        for converter in self.converters:
            converter.convert(model)

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        for converter in self.converters:
            converter.post_optimizer_hook(model_parts)
