"""Qwen3 train spec: dense and MoE flavors (for MoE flavors with aux-loss-free balancing the
optimizer builder adds the expert-bias update)."""

from torchtitan.models.common.parallelize import parallelize_decoder
from torchtitan.models.common.spec_builder import decoder_train_spec
from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.models.qwen3.flavors import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.train_spec import register_train_spec

__all__ = ["Qwen3Model", "Qwen3ModelArgs", "qwen3_flavors"]

register_train_spec(
    decoder_train_spec(
        "qwen3",
        Qwen3Model,
        qwen3_flavors,
        parallelize_decoder,
        Qwen3StateDictAdapter,
        has_moe=True,
    )
)
