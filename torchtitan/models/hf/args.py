"""The arguments of a model built by transformers from a Hugging Face ``config.json``
(``model.name = "hf"``, ``model.hf_assets_path`` = the folder that holds it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.args import nparams_and_flops, require
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import ModelConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.tokenizer import BaseTokenizer

ATTENTION = "torchtitan"
"""The name our attention function is registered under in transformers' attention and
mask registries (``model.py``)."""

UNSUPPORTED_FIELDS = {"attn_logit_softcapping": "attention logit soft-capping"}
"""config.json fields (set, not None) that change the scores inside the attention kernel,
which the backend does not apply yet."""


def logit_multiplier(text_config: Any) -> float:
    """What transformers multiplies the logits by: Cohere's ``logit_scale``, Granite's and
    MiniCPM3's ``1 / logits_scaling`` (1 for the others)."""
    scale = getattr(text_config, "logit_scale", None) or 1.0
    return scale / (getattr(text_config, "logits_scaling", None) or 1.0)


def read_config_json(folder: str | None) -> dict[str, Any]:
    """``config.json`` of ``model.hf_assets_path`` as a dict (one line naming the field when
    it is missing or unreadable)."""
    if not folder:
        raise ConfigError(
            'model.hf_assets_path: model.name = "hf" builds the model from a Hugging Face '
            "folder's config.json; set model.hf_assets_path to that folder"
        )
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.hf_assets_path: {path} does not exist; point at a folder with config.json"
        )
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_assets_path: cannot read {path}: {e}") from None


def load_hf_config(folder: str | None) -> Any:
    """The transformers config of ``folder``, never with remote code: an ``auto_map`` that
    names a class transformers lacks is refused; one whose ``model_type`` transformers knows
    is ignored (its own classes are used)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = read_config_json(folder)
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        needs = (
            " (its auto_map names remote code, which is never run)" if raw.get("auto_map") else ""
        )
        raise ConfigError(
            f"model.hf_assets_path: config.json's model_type {model_type!r} is not a model of the "
            f"installed transformers{needs}; upgrade transformers or train a supported model"
        )
    if raw.get("auto_map"):
        logger.warning(
            f"model.hf_assets_path: config.json's auto_map is ignored; the installed "
            f"transformers' {model_type!r} classes are used (no remote code)"
        )
    try:
        config: PretrainedConfig = AutoConfig.for_model(**raw)
    except (ValueError, TypeError, StrictDataclassError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"model.hf_assets_path: config.json is not a valid {model_type} config ({reason}); "
            "fix the field it names or write the folder again with save_pretrained"
        ) from None
    text = config.get_text_config()
    if getattr(text, "output_router_logits", False) and getattr(text, "router_aux_loss_coef", 0):
        logger.warning(
            "model.hf_assets_path: config.json sets output_router_logits, but the hf backend "
            f"does not add transformers' load-balancing loss (router_aux_loss_coef "
            f"{text.router_aux_loss_coef}: batch-wise, so it would differ across data-parallel "
            "layouts); the routers train from the language-model loss alone"
        )
    for field, what in UNSUPPORTED_FIELDS.items():
        require(
            getattr(config, field, None) in (None, 1.0),
            f"model.hf_assets_path: config.json sets {field} ({what}), which the hf backend "
            "does not apply yet; train this model with transformers' own loop",
        )
    return config


@dataclass
class HFModelArgs(BaseModelArgs):
    """The config of the folder (``hf_config``, a transformers ``PretrainedConfig``), read
    by ``update_from_config``; the flavor ``full`` builds it as it is."""

    hf_config: Any = None
    max_seq_len: int = 2048

    def update_from_config(
        self,
        model: ModelConfig,
        *,
        max_seq_len: int,
        tokenizer: BaseTokenizer | None = None,
        moe_force_load_balance: bool = False,
    ) -> None:
        self.attn_type = model.attn_type
        self.attn_mask_type = model.attn_mask_type
        self.sliding_window = model.sliding_window
        self.max_seq_len = max_seq_len
        self.hf_config = load_hf_config(model.hf_assets_path)
        self.hf_config._attn_implementation = ATTENTION
        self.hf_config.use_cache = False
        vocab = self.hf_config.get_text_config().vocab_size
        if tokenizer is not None:
            require(
                tokenizer.vocab_size <= vocab,
                f"model.tokenizer_path: the tokenizer has {tokenizer.vocab_size} tokens, more than "
                f"the model's vocab_size ({vocab}) in {model.hf_assets_path}/config.json; use the "
                "model's own tokenizer (leave model.tokenizer_path unset)",
            )

    @property
    def n_heads(self) -> int:
        return self.hf_config.get_text_config().num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.get_text_config().vocab_size

    @property
    def n_layers(self) -> int:
        return self.hf_config.get_text_config().num_hidden_layers

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        text = self.hf_config.get_text_config()
        # from the dict: a config with per-layer attention sizes (Gemma 4) refuses the attribute
        head_dim = text.to_dict().get("head_dim") or text.hidden_size // text.num_attention_heads
        attention = 12 * text.num_hidden_layers * text.num_attention_heads * head_dim * seq_len
        tied = bool(getattr(text, "tie_word_embeddings", False))
        return nparams_and_flops(model, attention, tied_embeddings=tied)

    def check_parallelism(self, parallel_dims: ParallelDims) -> None:
        require(
            parallel_dims.etp == 1,
            "parallelism.expert_tensor_parallel_degree: the hf backend keeps each expert whole "
            "(expert tensor parallel is not built for it); leave the degree at 1",
        )
        text = self.hf_config.get_text_config()
        require(
            parallel_dims.pp == 1 or not getattr(text, "tie_word_embeddings", False),
            "parallelism.pipeline_parallel_degree: this model ties lm_head to the input "
            "embedding (tie_word_embeddings in its config.json), and the two sit on different "
            "pipeline stages; leave the degree at 1 or use an untied model",
        )
        multiplier = getattr(text, "embedding_multiplier", 1.0)
        require(
            parallel_dims.pp == 1 or multiplier in (None, 1.0),
            f"parallelism.pipeline_parallel_degree ({parallel_dims.pp}): this model's base "
            f"scales its input embeddings in its forward (embedding_multiplier {multiplier}), "
            "which every pipeline stage would repeat; leave the degree at 1",
        )
