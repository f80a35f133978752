"""DeepSeek-V3 train spec: MLA attention, MoE with expert parallel and aux-loss-free load
balancing (the optimizer builder adds the expert-bias update)."""

from torchtitan.components.dataloader import build_dataloader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_moe_optimizers
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.components.validate import build_validator
from torchtitan.distributed.pipeline import pipeline_llm
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.flavors import deepseek_v3_flavors
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseek_v3
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

__all__ = ["DeepSeekV3Model", "DeepSeekV3ModelArgs", "deepseek_v3_flavors", "parallelize_deepseek_v3"]

register_train_spec(
    TrainSpec(
        name="deepseek_v3",
        model_cls=DeepSeekV3Model,
        model_args=deepseek_v3_flavors,
        parallelize_fn=parallelize_deepseek_v3,
        pipelining_fn=pipeline_llm,
        build_optimizers_fn=build_moe_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        build_validator_fn=build_validator,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
    )
)
