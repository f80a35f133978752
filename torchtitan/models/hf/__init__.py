"""The hf train spec: any causal LM of the installed transformers, from the config.json of
``model.hf_assets_path`` (flavor ``full``)."""

from torchtitan.models.common.spec_builder import decoder_train_spec
from torchtitan.models.hf.args import HFModelArgs
from torchtitan.models.hf.model import HFCausalLM
from torchtitan.models.hf.parallelize import parallelize_hf
from torchtitan.models.hf.state_dict_adapter import HFStateDictAdapter
from torchtitan.protocols.train_spec import register_train_spec

__all__ = ["HFCausalLM", "HFModelArgs"]

register_train_spec(
    decoder_train_spec(
        "hf",
        HFCausalLM,
        {"full": HFModelArgs()},
        parallelize_hf,
        HFStateDictAdapter,
        has_moe=False,
    )
)
