"""The train spec of a decoder built on ``models/common``: its own model, flavors,
parallelize function and state-dict adapter, and the shared builders (pipeline split,
AdamW-family optimizers with the MoE expert-bias update hook, LR schedule, data, tokenizer,
summed cross-entropy, validator)."""

from __future__ import annotations

from torch import nn

from torchtitan.components.optimizers.builder import build_moe_optimizers, build_optimizers
from torchtitan.components.optimizers.lr_schedule import build_lr_schedulers
from torchtitan.components.validate import build_validator
from torchtitan.data.loader import build_dataloader
from torchtitan.data.tokenizers import build_tokenizer
from torchtitan.distributed.pipeline import pipeline_llm
from torchtitan.layers.loss import build_cross_entropy_loss
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.protocols.train_spec import ParallelizeFunction, TrainSpec


def decoder_train_spec(
    name: str,
    model_cls: type[nn.Module],
    flavors: dict[str, BaseModelArgs],
    parallelize_fn: ParallelizeFunction,
    state_dict_adapter: type[StateDictAdapter],
    *,
    has_moe: bool,
) -> TrainSpec:
    """``has_moe``: some flavors have MoE layers (the optimizers then update expert biases)."""
    return TrainSpec(
        name=name,
        model_cls=model_cls,
        model_args=flavors,
        parallelize_fn=parallelize_fn,
        pipelining_fn=pipeline_llm,
        build_optimizers_fn=build_moe_optimizers if has_moe else build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        build_validator_fn=build_validator,
        state_dict_adapter=state_dict_adapter,
    )
