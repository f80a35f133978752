"""Conversion between our Llama 3 checkpoints and Hugging Face ``LlamaForCausalLM``.

Besides renaming keys (``models/common/hf_keys.py``), the q/k projections are permuted: we
rotate adjacent channel pairs ``(2i, 2i + 1)`` of each head (Meta's layout), while Hugging
Face rotates channel ``i`` with ``i + head_dim / 2`` ("rotate half"). The permutations are
pure re-indexing, so a round trip is bit-exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.common.hf_keys import (
    DENSE_BLOCK,
    GQA,
    DecoderStateDictAdapter,
    check_same_fields,
    rope_settings,
)
from torchtitan.models.llama3.args import TransformerModelArgs

_COMPARED = ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden_dim")


class Llama3StateDictAdapter(DecoderStateDictAdapter):
    """``to_hf``/``from_hf`` for :class:`~torchtitan.models.llama3.model.Transformer`."""

    model_args: TransformerModelArgs
    family = "Llama"
    per_layer = GQA | DENSE_BLOCK

    def hf_config(self) -> dict[str, Any]:
        return to_hf_config(self.model_args)

    def check_hf_config(self, config: dict[str, Any]) -> None:
        self.require_architecture(config, "LlamaForCausalLM", "Llama")
        theirs = from_hf_config(config)
        check_same_fields(
            {f: getattr(theirs, f) for f in _COMPARED},
            {f: getattr(self.model_args, f) for f in _COMPARED},
        )

    def rope_heads(self, key: str) -> int | None:
        """Number of heads whose rows need the RoPE permutation, or None."""
        return {
            "attention.wq.weight": self.model_args.n_heads,
            "attention.wk.weight": self.model_args.kv_heads,
        }.get(key)


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
    rope = rope_settings(config)
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
