"""Conversion between our gpt-oss checkpoints and Hugging Face ``GptOssForCausalLM``.

Besides renaming keys: the q/k projections and their biases are permuted between our
interleaved RoPE layout and Hugging Face's rotate-half one; the experts, which Hugging Face
keeps fused and transposed (``gate_up_proj`` ``[E, dim, 2 * hidden]`` with gate and up
interleaved column by column, ``down_proj`` ``[E, hidden, dim]``, a bias for each), split
into ``w1``/``w3`` ``[E, hidden, dim]`` and ``w2`` ``[E, dim, hidden]`` with ``b1``/``b3``/``b2``.
All of it is re-indexing, so round trips are bit-exact. Published checkpoints store the expert
weights as MXFP4 blocks and scales; the loader dequantises them
(``components/checkpointing/mxfp4.py``) before this adapter sees them. Export writes plain
tensors (the export dtype).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan.models.common.hf_keys import (
    GQA,
    DecoderStateDictAdapter,
    check_same_fields,
    require,
    rope_settings,
)
from torchtitan.models.gpt_oss.args import FULL, SLIDING, GptOssModelArgs, gpt_oss_moe

_PER_LAYER = (
    GQA
    | {ours.replace(".weight", ".bias"): hf.replace(".weight", ".bias") for ours, hf in GQA.items()}
    | {
        "attention.sinks": "self_attn.sinks",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "moe.router.gate.weight": "mlp.router.weight",
        "moe.router.gate.bias": "mlp.router.bias",
    }
)
# our expert tensors -> (Hugging Face's fused tensor, our tensor's half of it or None)
_EXPERTS = {
    "moe.experts.w1": ("mlp.experts.gate_up_proj", 0),
    "moe.experts.w3": ("mlp.experts.gate_up_proj", 1),
    "moe.experts.b1": ("mlp.experts.gate_up_proj_bias", 0),
    "moe.experts.b3": ("mlp.experts.gate_up_proj_bias", 1),
    "moe.experts.w2": ("mlp.experts.down_proj", None),
    "moe.experts.b2": ("mlp.experts.down_proj_bias", None),
}
_FUSED = {
    "mlp.experts.gate_up_proj": ("moe.experts.w1", "moe.experts.w3"),
    "mlp.experts.gate_up_proj_bias": ("moe.experts.b1", "moe.experts.b3"),
}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _to_hf_expert(value: torch.Tensor, weight: bool) -> torch.Tensor:
    """Ours ``[E, out, in]`` -> theirs ``[E, in, out]`` (a bias ``[E, out]`` is the same)."""
    return value.transpose(1, 2) if weight else value


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Hugging Face's fused layout along the last dim: gate 0, up 0, gate 1, up 1, ..."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


class GptOssStateDictAdapter(DecoderStateDictAdapter):
    """``to_hf``/``from_hf`` for :class:`~torchtitan.models.gpt_oss.model.GptOssModel`."""

    model_args: GptOssModelArgs
    family = "gpt-oss"
    per_layer = _PER_LAYER

    def hf_config(self) -> dict[str, Any]:
        return to_hf_config(self.model_args)

    def check_hf_config(self, config: dict[str, Any]) -> None:
        self.require_architecture(config, "GptOssForCausalLM", "gpt-oss")
        check_same_fields(
            _compared_fields(from_hf_config(config)), _compared_fields(self.model_args)
        )

    def rope_heads(self, key: str) -> int | None:
        args = self.model_args
        return {
            "attention.wq.weight": args.n_heads,
            "attention.wq.bias": args.n_heads,
            "attention.wk.weight": args.n_kv_heads,
            "attention.wk.bias": args.n_kv_heads,
        }.get(key)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Expert halves (``w1``/``w3``, ``b1``/``b3``) fuse only together; a lone half
        converts only on the meta device (listing the keys a parameter needs)."""
        rest, out = {}, {}
        fused: dict[str, dict[int, torch.Tensor]] = {}  # HF key -> {half: tensor}
        for key, value in state_dict.items():
            match = _LAYER_KEY.fullmatch(key)
            if match is None or match.group(2) not in _EXPERTS:
                rest[key] = value
                continue
            layer, ours = match.groups()
            hf_name, half = _EXPERTS[ours]
            converted = _to_hf_expert(value, ours.startswith("moe.experts.w"))
            hf_key = f"model.layers.{layer}.{hf_name}"
            if half is None:
                out[hf_key] = converted
            else:
                fused.setdefault(hf_key, {})[half] = converted
        for hf_key, by_half in fused.items():
            if len(by_half) == 2:
                out[hf_key] = _interleave(by_half[0], by_half[1])
            elif (only := next(iter(by_half.values()))).is_meta:
                out[hf_key] = _interleave(only, only)
            else:
                raise ValueError(f"{hf_key} fuses gate and up: convert both expert halves together")
        return super().to_hf(rest) | out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        rest, out = {}, {}
        by_ours = {hf: ours for ours, (hf, half) in _EXPERTS.items() if half is None}
        for hf_key, value in hf_state_dict.items():
            match = _HF_LAYER_KEY.fullmatch(hf_key)
            name = match.group(2) if match else None
            prefix = f"layers.{match.group(1)}." if match else ""
            if name in _FUSED:
                gate, up = _FUSED[name]
                weight = not name.endswith("_bias")
                out[prefix + gate] = _to_hf_expert(value[..., 0::2], weight).contiguous()
                out[prefix + up] = _to_hf_expert(value[..., 1::2], weight).contiguous()
            elif name in by_ours:
                ours = by_ours[name]
                out[prefix + ours] = _to_hf_expert(value, ours.startswith("moe.experts.w"))
            else:
                rest[hf_key] = value
        return super().from_hf(rest) | out


def to_hf_config(args: GptOssModelArgs) -> dict[str, Any]:
    """A ``transformers.GptOssConfig``-compatible dict for ``args`` (RoPE settings in both
    the 5.x ``rope_parameters`` and the 4.x ``rope_theta``/``rope_scaling`` forms)."""
    scaling = {
        "rope_type": "yarn",
        "factor": args.rope_factor,
        "original_max_position_embeddings": args.rope_original_seq_len,
        "beta_fast": args.rope_beta_fast,
        "beta_slow": args.rope_beta_slow,
        "truncate": args.rope_truncate,
    }
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "sliding_window": args.attention_window,
        "layer_types": list(args.layer_types),
        "num_local_experts": args.moe.num_experts,
        "num_experts_per_tok": args.moe.top_k,
        "swiglu_limit": args.moe.swiglu_limit,
        "swiglu_alpha": args.moe.swiglu_alpha,
        "attention_bias": True,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_theta": args.rope_theta} | scaling,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
    }


def from_hf_config(config: Mapping[str, Any]) -> GptOssModelArgs:
    """Model args equivalent to a Hugging Face gpt-oss config dict (``max_seq_len`` is left
    at its default: the trainer sets it from ``training.seq_len``)."""
    rope = rope_settings(config)
    problems = [
        (rope["rope_type"] != "yarn", f"unsupported rope_type {rope['rope_type']!r}"),
        (config.get("tie_word_embeddings"), "tied embeddings are not gpt-oss's"),
        (config.get("attention_bias") is False, "gpt-oss needs attention biases"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(f"config.json: {message}")
    n_layers = require(config, "num_hidden_layers")
    layer_types = list(config.get("layer_types") or [])
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"config.json: unknown layer_types {unknown}")
    moe = gpt_oss_moe(require(config, "num_local_experts"), require(config, "num_experts_per_tok"))
    moe.swiglu_limit = float(config.get("swiglu_limit", 7.0))
    moe.swiglu_alpha = float(config.get("swiglu_alpha", 1.702))
    return GptOssModelArgs(
        vocab_size=require(config, "vocab_size"),
        dim=require(config, "hidden_size"),
        n_layers=n_layers,
        n_heads=require(config, "num_attention_heads"),
        n_kv_heads=require(config, "num_key_value_heads"),
        head_dim=require(config, "head_dim"),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        layer_types=layer_types,
        attention_window=require(config, "sliding_window"),
        rope_theta=float(rope["rope_theta"]),
        rope_factor=float(require(rope, "factor")),
        rope_original_seq_len=int(require(rope, "original_max_position_embeddings")),
        rope_beta_fast=float(rope.get("beta_fast") or 32.0),
        rope_beta_slow=float(rope.get("beta_slow") or 1.0),
        rope_truncate=bool(rope.get("truncate", True)),
        moe=moe,
        moe_hidden_dim=require(config, "intermediate_size"),
    )


def _compared_fields(args: GptOssModelArgs) -> dict[str, Any]:
    """What makes two configurations compute different functions, in comparable form."""
    return {
        "n_layers": args.n_layers,
        "dim": args.dim,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "norm_eps": args.norm_eps,
        "layer_types": list(args.layer_types),
        "attention_window": args.attention_window,
        "rope_theta": args.rope_theta,
        "rope_factor": args.rope_factor,
        "rope_original_seq_len": args.rope_original_seq_len,
        "rope_truncate": args.rope_truncate,
        "moe.num_experts": args.moe.num_experts,
        "moe.top_k": args.moe.top_k,
        "moe.swiglu_limit": args.moe.swiglu_limit,
        "moe_hidden_dim": args.moe_hidden_dim,
    }
