"""Qwen3.5 train spec: hybrid Gated DeltaNet / gated attention text models, dense and MoE."""

from torchtitan.models.common.spec_builder import decoder_train_spec
from torchtitan.models.qwen3_5.args import Qwen3_5ModelArgs
from torchtitan.models.qwen3_5.flavors import qwen3_5_flavors
from torchtitan.models.qwen3_5.model import Qwen3_5Model
from torchtitan.models.qwen3_5.parallelize import parallelize_qwen3_5
from torchtitan.models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter
from torchtitan.protocols.train_spec import register_train_spec

__all__ = ["Qwen3_5Model", "Qwen3_5ModelArgs", "parallelize_qwen3_5", "qwen3_5_flavors"]

register_train_spec(
    decoder_train_spec(
        "qwen3_5",
        Qwen3_5Model,
        qwen3_5_flavors,
        parallelize_qwen3_5,
        Qwen3_5StateDictAdapter,
        has_moe=True,
    )
)
