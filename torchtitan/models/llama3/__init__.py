"""Llama 3 train spec."""

from torchtitan.components.dataloader import build_dataloader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.distributed.pipeline import pipeline_llm
from torchtitan.components.validate import build_validator
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

__all__ = ["Transformer", "TransformerModelArgs", "llama3_flavors", "parallelize_llama"]

register_train_spec(
    TrainSpec(
        name="llama3",
        model_cls=Transformer,
        model_args=llama3_flavors,
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_llm,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        build_validator_fn=build_validator,
        state_dict_adapter=Llama3StateDictAdapter,
    )
)
