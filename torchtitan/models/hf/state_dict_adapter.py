"""Hugging Face checkpoints of ``HFCausalLM``: its FQNs are transformers' own, so keys map
one to one; a tied ``lm_head.weight`` is left out of what is written (as transformers
does) and taken from the input embedding when a checkpoint lacks it."""

from __future__ import annotations

from typing import Any

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

LM_HEAD = "lm_head.weight"


class HFStateDictAdapter(StateDictAdapter):
    def _tied(self) -> bool:
        return bool(self.model_args.hf_config.get_text_config().tie_word_embeddings)

    def _embedding_key(self) -> str:
        from transformers import AutoModelForCausalLM

        prefix = AutoModelForCausalLM._model_mapping[
            type(self.model_args.hf_config)
        ].base_model_prefix
        return f"{prefix}.embed_tokens.weight"

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._tied():
            return {key: value for key, value in state_dict.items() if key != LM_HEAD}
        return dict(state_dict)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        state = dict(hf_state_dict)
        embedding = self._embedding_key()
        if self._tied() and LM_HEAD not in state and embedding in state:
            state[LM_HEAD] = state[embedding]
        return state

    def hf_config(self) -> dict[str, Any]:
        """The folder's config as transformers writes it."""
        config = self.model_args.hf_config.to_dict()
        config.pop("_attn_implementation_autoset", None)
        config.pop("attn_implementation", None)
        return config
