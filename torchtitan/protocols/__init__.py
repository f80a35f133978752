from torchtitan.protocols.model import BaseModelArgs, ModelProtocol
from torchtitan.protocols.model_converter import (
    ModelConverter,
    ModelConvertersContainer,
    register_model_converter,
)
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.protocols.tokenizer import BaseTokenizer
from torchtitan.protocols.train_spec import (
    TrainSpec,
    apply_to_train_specs,
    get_train_spec,
    register_train_spec,
)

__all__ = [
    "BaseModelArgs",
    "BaseTokenizer",
    "ModelProtocol",
    "ModelConverter",
    "ModelConvertersContainer",
    "register_model_converter",
    "StateDictAdapter",
    "TrainSpec",
    "apply_to_train_specs",
    "get_train_spec",
    "register_train_spec",
]
