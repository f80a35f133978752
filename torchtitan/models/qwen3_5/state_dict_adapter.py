"""Conversion between our Qwen3.5 checkpoints and Hugging Face's Qwen3.5 text models
(``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``), reading the published multimodal
checkpoints too (``Qwen3_5ForConditionalGeneration``: the language model under
``model.language_model.``; the vision tower and the multi-token-prediction head are skipped
with one warning).

Besides renaming keys: Gated DeltaNet's fused ``in_proj_qkv`` and ``conv1d`` (``[channels,
1, kernel]``) split into our per-part projections and ``[channels, kernel]`` taps; the rotary
rows of the attention's q (each head's query half; the gate half is not rotated) and k
projections and of the q/k norms are permuted between our interleaved RoPE layout and
Hugging Face's rotate-half one. All re-indexing, so round trips are bit-exact. Experts: one
tensor per expert as published (transformers' fused in-memory layout is read too).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan.models.common.hf_keys import (
    DENSE_BLOCK,
    GQA,
    ROUTER,
    DecoderStateDictAdapter,
    check_same_fields,
    interleaved_to_rotate_half,
    require,
    rope_settings,
    rotate_half_to_interleaved,
)
from torchtitan.models.qwen3_5.args import DELTA_RULE, FULL, Qwen3_5ModelArgs, qwen3_5_moe
from torchtitan.tools.logging import logger

_LINEAR = {
    f"attention.{ours}": f"linear_attn.{theirs}"
    for ours, theirs in {
        "z_proj.weight": "in_proj_z.weight",
        "b_proj.weight": "in_proj_b.weight",
        "a_proj.weight": "in_proj_a.weight",
        "out_proj.weight": "out_proj.weight",
        "dt_bias": "dt_bias",
        "A_log": "A_log",
        "norm.weight": "norm.weight",
    }.items()
}
_FULL = GQA | {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_MOE = ROUTER | {
    "moe.shared_experts.w1": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_experts.w2": "mlp.shared_expert.down_proj.weight",
    "moe.shared_experts.w3": "mlp.shared_expert.up_proj.weight",
    "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
# our split Gated DeltaNet tensors -> (Hugging Face's fused tensor, our part's index)
_SPLIT = {
    "attention.q_proj.weight": ("linear_attn.in_proj_qkv.weight", 0),
    "attention.k_proj.weight": ("linear_attn.in_proj_qkv.weight", 1),
    "attention.v_proj.weight": ("linear_attn.in_proj_qkv.weight", 2),
    "attention.q_conv": ("linear_attn.conv1d.weight", 0),
    "attention.k_conv": ("linear_attn.conv1d.weight", 1),
    "attention.v_conv": ("linear_attn.conv1d.weight", 2),
}
_FUSED = {
    "linear_attn.in_proj_qkv.weight": (
        "attention.q_proj.weight",
        "attention.k_proj.weight",
        "attention.v_proj.weight",
    ),
    "linear_attn.conv1d.weight": ("attention.q_conv", "attention.k_conv", "attention.v_conv"),
}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MULTIMODAL_PREFIX = "model.language_model."
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")


class Qwen3_5StateDictAdapter(DecoderStateDictAdapter):
    """``to_hf``/``from_hf`` for :class:`~torchtitan.models.qwen3_5.model.Qwen3_5Model`.
    Keys are written in the text model's layout (``model.layers.N``) unless
    :meth:`check_hf_config` saw a multimodal checkpoint, whose keys are then read in place."""

    model_args: Qwen3_5ModelArgs
    family = "Qwen3.5"
    per_layer = _LINEAR | _FULL | DENSE_BLOCK | _MOE

    def __init__(self, model_args: Any, hf_assets_path: str | None = None) -> None:
        super().__init__(model_args, hf_assets_path)
        self.hf_prefix = "model."

    def hf_config(self) -> dict[str, Any]:
        return to_hf_config(self.model_args)

    def check_hf_config(self, config: dict[str, Any]) -> None:
        moe = self.model_args.moe is not None
        family = "Qwen3_5Moe" if moe else "Qwen3_5"
        architectures = config.get("architectures") or []
        if f"{family}ForConditionalGeneration" in architectures:
            self.hf_prefix = _MULTIMODAL_PREFIX
        else:
            self.require_architecture(config, f"{family}ForCausalLM", "Qwen3.5")
        check_same_fields(
            _compared_fields(from_hf_config(config)), _compared_fields(self.model_args)
        )

    def _rotary(self, key: str) -> tuple[int, int] | None:
        """(heads, rows per head) of a tensor whose rows carry rotated channels."""
        args = self.model_args
        return {
            "attention.wq.weight": (args.n_heads, 2 * args.head_dim),
            "attention.wk.weight": (args.n_kv_heads, args.head_dim),
            "attention.q_norm.weight": (1, args.head_dim),
            "attention.k_norm.weight": (1, args.head_dim),
        }.get(key)

    def value_to_hf(self, key: str, value: torch.Tensor) -> torch.Tensor:
        return self._permute(key, value, interleaved_to_rotate_half)

    def value_from_hf(self, key: str, value: torch.Tensor) -> torch.Tensor:
        return self._permute(key, value, rotate_half_to_interleaved)

    def _permute(self, key: str, value: torch.Tensor, reorder: Any) -> torch.Tensor:
        """Reorder the first ``rotary_dim`` rows of each head (pure re-indexing)."""
        layout = self._rotary(key)
        if layout is None:
            return value
        heads, rows = layout
        if value.shape[0] != heads * rows:
            raise ValueError(
                f"{key!r} has {value.shape[0]} rows, expected {heads} heads x {rows} = "
                f"{heads * rows}"
            )
        rotary = self.model_args.rotary_dim
        blocks = value.reshape(heads, rows, *value.shape[1:])
        rotated = reorder(
            blocks[:, :rotary].reshape(heads * rotary, *value.shape[1:]), heads, rotary
        )
        rotated = rotated.reshape(heads, rotary, *value.shape[1:])
        return torch.cat([rotated, blocks[:, rotary:]], dim=1).reshape(value.shape)

    def _split_sizes(self) -> list[int]:
        args = self.model_args
        key_dim = args.delta_rule_n_k_heads * args.delta_rule_k_head_dim
        return [key_dim, key_dim, args.delta_rule_n_v_heads * args.delta_rule_v_head_dim]

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The three parts of a fused tensor fuse only together; a lone part converts only on
        the meta device (listing the keys a parameter needs)."""
        rest: dict[str, Any] = {}
        fused: dict[str, dict[int, torch.Tensor]] = {}
        for key, value in state_dict.items():
            match = _LAYER_KEY.fullmatch(key)
            if match is None or match.group(2) not in _SPLIT:
                rest[key] = value
                continue
            hf_name, part = _SPLIT[match.group(2)]
            fused.setdefault(f"model.layers.{match.group(1)}.{hf_name}", {})[part] = value
        out = super().to_hf(rest)
        for hf_key, parts in fused.items():
            if len(parts) == 3:
                value = torch.cat([parts[i] for i in range(3)])
            elif (only := next(iter(parts.values()))).is_meta:
                value = torch.empty(sum(self._split_sizes()), *only.shape[1:], device="meta")
            else:
                raise ValueError(f"{hf_key} fuses q, k and v: convert the three parts together")
            out[hf_key] = value.unsqueeze(1) if hf_key.endswith("conv1d.weight") else value
        if self.model_args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return {self._prefixed(k): v for k, v in out.items()}

    def _prefixed(self, key: str) -> str:
        return self.hf_prefix + key.removeprefix("model.") if key.startswith("model.") else key

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        rest, out, skipped = {}, {}, []
        for hf_key, value in hf_state_dict.items():
            if hf_key.startswith(_SKIPPED_PREFIXES):
                skipped.append(hf_key)
                continue
            if hf_key.startswith(_MULTIMODAL_PREFIX):
                hf_key = "model." + hf_key.removeprefix(_MULTIMODAL_PREFIX)
            match = _HF_LAYER_KEY.fullmatch(hf_key)
            if match is None or match.group(2) not in _FUSED:
                rest[hf_key] = value
                continue
            if match.group(2) == "linear_attn.conv1d.weight":
                value = value.squeeze(1)
            parts = value.split(self._split_sizes())
            for ours, part in zip(_FUSED[match.group(2)], parts):
                out[f"layers.{match.group(1)}.{ours}"] = part
        if skipped:
            logger.warning(
                f"Qwen3.5: skipping {len(skipped)} tensors of the vision tower / multi-token "
                "prediction head (text-only model)"
            )
        out |= super().from_hf(rest)
        if self.model_args.tie_word_embeddings and "tok_embeddings.weight" in out:
            out.setdefault("output.weight", out["tok_embeddings.weight"])
        return out


def to_hf_config(args: Qwen3_5ModelArgs) -> dict[str, Any]:
    """A ``transformers.Qwen3_5TextConfig`` (or ``Qwen3_5MoeTextConfig``)-compatible dict."""
    config: dict[str, Any] = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "layer_types": list(args.layer_types),
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "linear_num_key_heads": args.delta_rule_n_k_heads,
        "linear_num_value_heads": args.delta_rule_n_v_heads,
        "linear_key_head_dim": args.delta_rule_k_head_dim,
        "linear_value_head_dim": args.delta_rule_v_head_dim,
        "linear_conv_kernel_dim": args.delta_rule_conv_kernel,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
    }
    moe = args.moe
    if moe is None:
        return config
    return config | {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "shared_expert_intermediate_size": args.shared_expert_hidden_dim,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
    }


def from_hf_config(config: Mapping[str, Any]) -> Qwen3_5ModelArgs:
    """Model args equivalent to a Hugging Face Qwen3.5 config dict (text or multimodal: the
    latter's ``text_config``); ``max_seq_len`` is left at its default (the trainer sets it
    from ``training.seq_len``)."""
    text = config.get("text_config") or config
    rope = rope_settings(text)
    problems = [
        (rope["rope_type"] != "default", f"unsupported rope_type {rope['rope_type']!r}"),
        (text.get("attention_bias"), "attention biases are not supported"),
        (
            text.get("hidden_act", "silu") != "silu",
            f"unsupported hidden_act {text.get('hidden_act')!r}",
        ),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(f"config.json: {message}")
    layer_types = list(text.get("layer_types") or [])
    unknown = sorted(set(layer_types) - {DELTA_RULE, FULL})
    if unknown:
        raise ValueError(f"config.json: unknown layer_types {unknown}")
    args = Qwen3_5ModelArgs(
        vocab_size=require(text, "vocab_size"),
        dim=require(text, "hidden_size"),
        n_layers=require(text, "num_hidden_layers"),
        layer_types=layer_types,
        full_attention_interval=text.get("full_attention_interval", 4),
        n_heads=require(text, "num_attention_heads"),
        n_kv_heads=require(text, "num_key_value_heads"),
        head_dim=require(text, "head_dim"),
        rope_theta=float(rope["rope_theta"]),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
        delta_rule_n_k_heads=require(text, "linear_num_key_heads"),
        delta_rule_n_v_heads=require(text, "linear_num_value_heads"),
        delta_rule_k_head_dim=require(text, "linear_key_head_dim"),
        delta_rule_v_head_dim=require(text, "linear_value_head_dim"),
        delta_rule_conv_kernel=text.get("linear_conv_kernel_dim", 4),
        ffn_hidden_dim=text.get("intermediate_size") or 0,
        norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(
            text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        ),
    )
    if num_experts := text.get("num_experts"):
        args.moe = qwen3_5_moe(num_experts, require(text, "num_experts_per_tok"))
        args.moe_hidden_dim = require(text, "moe_intermediate_size")
        args.shared_expert_hidden_dim = require(text, "shared_expert_intermediate_size")
    return args


def _compared_fields(args: Qwen3_5ModelArgs) -> dict[str, Any]:
    """What makes two configurations compute different functions, in comparable form."""
    fields = {
        "n_layers": args.n_layers,
        "layer_types": list(args.layer_types),
        "dim": args.dim,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rope_theta": args.rope_theta,
        "partial_rotary_factor": args.partial_rotary_factor,
        "delta_rule_n_k_heads": args.delta_rule_n_k_heads,
        "delta_rule_n_v_heads": args.delta_rule_n_v_heads,
        "delta_rule_k_head_dim": args.delta_rule_k_head_dim,
        "delta_rule_v_head_dim": args.delta_rule_v_head_dim,
        "delta_rule_conv_kernel": args.delta_rule_conv_kernel,
        "vocab_size": args.vocab_size,
        "norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_word_embeddings,
        "moe": args.moe is not None,
    }
    if args.moe is None:
        return fields | {"ffn_hidden_dim": args.ffn_hidden_dim}
    return fields | {
        "moe.num_experts": args.moe.num_experts,
        "moe.top_k": args.moe.top_k,
        "moe_hidden_dim": args.moe_hidden_dim,
        "shared_expert_hidden_dim": args.shared_expert_hidden_dim,
    }
