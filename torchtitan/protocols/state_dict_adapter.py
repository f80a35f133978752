"""Mapping between our model's state dict and a Hugging Face checkpoint's."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class StateDictAdapter(ABC):
    """One per model. ``to_hf``/``from_hf`` rename keys and reshape tensors
    (e.g. the q/k RoPE layout) so that weights move between the two ecosystems."""

    def __init__(self, model_args: Any, hf_assets_path: str | None = None) -> None:
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path

    @abstractmethod
    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Our FQNs -> Hugging Face keys."""

    @abstractmethod
    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face keys -> our FQNs."""

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` contents describing this model to transformers."""
        raise NotImplementedError(f"{type(self).__name__} cannot write a Hugging Face config.json")

    def check_hf_config(self, config: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Raise ValueError (naming the field) when a Hugging Face config.json describes
        another architecture or other dimensions than this model."""

    @staticmethod
    def require_architecture(config: dict[str, Any], architecture: str, family: str) -> None:
        """Raise ValueError unless ``config.json`` lists ``architecture`` (e.g.
        ``LlamaForCausalLM``); ``family`` names the checkpoint to point at instead."""
        architectures = config.get("architectures") or []
        if architecture not in architectures:
            raise ValueError(
                f"config.json describes {architectures or 'an unknown architecture'}, not "
                f"{architecture}; point at a {family} checkpoint or choose the matching model.name"
            )
