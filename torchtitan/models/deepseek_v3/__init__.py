"""DeepSeek-V3 train spec: MLA attention, MoE with expert parallel and aux-loss-free load
balancing (the optimizer builder adds the expert-bias update)."""

from torchtitan.models.common.spec_builder import decoder_train_spec
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.flavors import deepseek_v3_flavors
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseek_v3
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.protocols.train_spec import register_train_spec

__all__ = [
    "DeepSeekV3Model",
    "DeepSeekV3ModelArgs",
    "deepseek_v3_flavors",
    "parallelize_deepseek_v3",
]

register_train_spec(
    decoder_train_spec(
        "deepseek_v3",
        DeepSeekV3Model,
        deepseek_v3_flavors,
        parallelize_deepseek_v3,
        DeepSeekV3StateDictAdapter,
        has_moe=True,
    )
)
