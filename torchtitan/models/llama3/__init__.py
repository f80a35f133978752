"""Llama 3 train spec."""

from torchtitan.models.common.parallelize import parallelize_decoder
from torchtitan.models.common.spec_builder import decoder_train_spec
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.train_spec import register_train_spec

__all__ = ["Transformer", "TransformerModelArgs", "llama3_flavors"]

register_train_spec(
    decoder_train_spec(
        "llama3",
        Transformer,
        llama3_flavors,
        parallelize_decoder,
        Llama3StateDictAdapter,
        has_moe=False,
    )
)
