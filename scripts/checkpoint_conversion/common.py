"""Shared by the conversion scripts: build the full model of a job config on the CPU."""

from __future__ import annotations

import torch

from torchtitan.config import ConfigManager
from torchtitan.protocols import get_train_spec
from torchtitan.recipe import model_args_from_config


def build_cpu_model(config_args: list[str]):
    """(model, train spec, model args) for the model/flavor/tokenizer of the given config
    flags, initialised on the CPU (weights are overwritten by the caller's load)."""
    config = ConfigManager().parse_args(config_args)
    spec = get_train_spec(config.model.name)
    tokenizer = spec.build_tokenizer_fn(config.model) if spec.build_tokenizer_fn else None
    args = model_args_from_config(spec, config, tokenizer)
    if spec.state_dict_adapter is None:
        raise SystemExit(f"error: model {spec.name!r} has no Hugging Face state-dict adapter")
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights(seed=0)
    return model, spec, args
