"""Conversion between our Llama 3 checkpoints and Hugging Face ``LlamaForCausalLM``.

Besides renaming keys, the q/k projections must be permuted: we rotate
adjacent channel pairs ``(2i, 2i + 1)`` of each head (Meta's layout), while
Hugging Face rotates channel ``i`` with ``i + head_dim / 2`` ("rotate half").
The permutations are pure re-indexing, so a round trip is bit-exact. Tensors
are expected to be full (not sharded DTensors).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_OURS_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TO_OURS_TOP = {hf: ours for ours, hf in _TOP_LEVEL.items()}
_TO_OURS_LAYER = {hf: ours for ours, hf in _PER_LAYER.items()}


def _interleaved_to_rotate_half(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder each head's output rows ``(0, 1, 2, 3, ...)`` ->
    ``(0, 2, 4, ..., 1, 3, 5, ...)``."""
    return w.reshape(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _rotate_half_to_interleaved(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Exact inverse of :func:`_interleaved_to_rotate_half`."""
    return w.reshape(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


class Llama3StateDictAdapter(StateDictAdapter):
    """``to_hf``/``from_hf`` for :class:`~torchtitan.models.llama3.model.Transformer`.

    Works on partial state dicts (e.g. one pipeline stage's); a key with no
    counterpart raises ``ValueError``.
    """

    model_args: TransformerModelArgs

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {self._hf_key(k): self._permute_to_hf(k, v) for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for hf_key, value in hf_state_dict.items():
            key = self._our_key(hf_key)
            out[key] = self._permute_from_hf(key, value)
        return out

    def hf_config(self) -> dict[str, Any]:
        return to_hf_config(self.model_args)

    def check_hf_config(self, config: dict[str, Any]) -> None:
        self.require_architecture(config, "LlamaForCausalLM", "Llama")
        theirs = from_hf_config(config)
        ours = self.model_args
        for field in ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden_dim"):
            if getattr(theirs, field) != getattr(ours, field):
                raise ValueError(
                    f"config.json has {field} = {getattr(theirs, field)} but model.flavor gives "
                    f"{getattr(ours, field)}; choose the flavor (or tokenizer) that matches"
                )

    def _hf_key(self, key: str) -> str:
        if key in _TOP_LEVEL:
            return _TOP_LEVEL[key]
        match = _OURS_LAYER_KEY.fullmatch(key)
        if match is None or match.group(2) not in _PER_LAYER:
            raise ValueError(f"no Hugging Face counterpart for key {key!r}")
        return f"model.layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}"

    def _our_key(self, hf_key: str) -> str:
        if hf_key in _TO_OURS_TOP:
            return _TO_OURS_TOP[hf_key]
        match = _HF_LAYER_KEY.fullmatch(hf_key)
        if match is None or match.group(2) not in _TO_OURS_LAYER:
            raise ValueError(f"unknown Hugging Face Llama key {hf_key!r}")
        return f"layers.{match.group(1)}.{_TO_OURS_LAYER[match.group(2)]}"

    def _rope_heads(self, key: str) -> int | None:
        """Number of heads whose rows need the RoPE permutation, or None."""
        if key.endswith("attention.wq.weight"):
            return self.model_args.n_heads
        if key.endswith("attention.wk.weight"):
            return self.model_args.kv_heads
        return None

    def _permute_to_hf(self, key: str, value: torch.Tensor) -> torch.Tensor:
        n_heads = self._rope_heads(key)
        if n_heads is None:
            return value
        self._check_rows(key, value, n_heads)
        return _interleaved_to_rotate_half(value, n_heads, self.model_args.head_dim)

    def _permute_from_hf(self, key: str, value: torch.Tensor) -> torch.Tensor:
        n_heads = self._rope_heads(key)
        if n_heads is None:
            return value
        self._check_rows(key, value, n_heads)
        return _rotate_half_to_interleaved(value, n_heads, self.model_args.head_dim)

    def _check_rows(self, key: str, value: torch.Tensor, n_heads: int) -> None:
        expected = n_heads * self.model_args.head_dim
        if value.shape[0] != expected:
            raise ValueError(
                f"{key!r} has {value.shape[0]} rows, expected {n_heads} heads x "
                f"{self.model_args.head_dim} = {expected}"
            )


def to_hf_config(model_args: TransformerModelArgs) -> dict[str, Any]:
    """A ``transformers.LlamaConfig``-compatible dict for ``model_args``.

    RoPE settings are written both as ``rope_parameters`` (transformers 5.x)
    and as ``rope_theta``/``rope_scaling`` (4.x).
    """
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": model_args.rope_theta}
    if model_args.use_scaled_rope:
        rope_parameters.update(
            rope_type="llama3",
            factor=model_args.rope_scale_factor,
            low_freq_factor=model_args.rope_low_freq_factor,
            high_freq_factor=model_args.rope_high_freq_factor,
            original_max_position_embeddings=model_args.rope_original_max_position_embeddings,
        )
    rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model_args.dim,
        "intermediate_size": model_args.ffn_hidden_dim,
        "num_attention_heads": model_args.n_heads,
        "num_key_value_heads": model_args.kv_heads,
        "num_hidden_layers": model_args.n_layers,
        "head_dim": model_args.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": model_args.norm_eps,
        "vocab_size": model_args.vocab_size,
        "max_position_embeddings": model_args.max_seq_len,
        "tie_word_embeddings": False,
        "rope_theta": model_args.rope_theta,
        "rope_scaling": rope_scaling if model_args.use_scaled_rope else None,
        "rope_parameters": rope_parameters,
    }


def _rope_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """Merge the 5.x ``rope_parameters`` and 4.x ``rope_theta``/``rope_scaling`` forms."""
    settings: dict[str, Any] = {"rope_theta": config.get("rope_theta", 10000.0)}
    settings.update(config.get("rope_scaling") or {})
    settings.update(config.get("rope_parameters") or {})
    settings.setdefault("rope_type", settings.get("type", "default"))
    return settings


def from_hf_config(config: Mapping[str, Any]) -> TransformerModelArgs:
    """Model args equivalent to a Hugging Face Llama config dict.

    ``intermediate_size`` need not follow our rounding formula, so it is
    expressed exactly as ``multiple_of = intermediate_size`` with
    ``ffn_dim_multiplier = intermediate_size / int(8 * dim / 3)``: the scaled
    size lands in ``(0, intermediate_size]`` and rounds up to it.
    """
    dim = config["hidden_size"]
    n_heads = config["num_attention_heads"]
    _reject_unsupported(config, dim, n_heads)
    rope = _rope_settings(config)
    if rope["rope_type"] not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope['rope_type']!r}")
    intermediate = config["intermediate_size"]
    args = TransformerModelArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        multiple_of=intermediate,
        ffn_dim_multiplier=intermediate / int(2 * 4 * dim / 3),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope["rope_theta"]),
        max_seq_len=config.get("max_position_embeddings", 2048),
    )
    if rope["rope_type"] == "llama3":
        args.use_scaled_rope = True
        args.rope_scale_factor = float(rope["factor"])
        args.rope_low_freq_factor = float(rope["low_freq_factor"])
        args.rope_high_freq_factor = float(rope["high_freq_factor"])
        args.rope_original_max_position_embeddings = int(rope["original_max_position_embeddings"])
    return args


def _reject_unsupported(config: Mapping[str, Any], dim: int, n_heads: int) -> None:
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim * n_heads != dim:
        raise ValueError(f"head_dim {head_dim} x {n_heads} heads != hidden_size {dim}")
    if config.get("tie_word_embeddings", False):
        raise ValueError("tied word embeddings are not supported")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention/MLP biases are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}")
