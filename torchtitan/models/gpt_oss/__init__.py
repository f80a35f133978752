"""gpt-oss train spec (20B, 120B and a CPU debug flavor)."""

from torchtitan.models.common.spec_builder import decoder_train_spec
from torchtitan.models.gpt_oss.args import GptOssModelArgs
from torchtitan.models.gpt_oss.flavors import gpt_oss_flavors
from torchtitan.models.gpt_oss.model import GptOssModel
from torchtitan.models.gpt_oss.parallelize import parallelize_gpt_oss
from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
from torchtitan.protocols.train_spec import register_train_spec

__all__ = ["GptOssModel", "GptOssModelArgs", "gpt_oss_flavors", "parallelize_gpt_oss"]

register_train_spec(
    decoder_train_spec(
        "gpt_oss",
        GptOssModel,
        gpt_oss_flavors,
        parallelize_gpt_oss,
        GptOssStateDictAdapter,
        has_moe=True,
    )
)
