"""Conversion between our DeepSeek-V3 checkpoints and Hugging Face ``DeepseekV3ForCausalLM``
(key tables: ``models/common/hf_keys.py``).

``to_hf`` writes the layout of the published safetensors files (and of transformers'
``save_pretrained``): one ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert.
``from_hf`` reads that layout and also transformers' in-memory fused one
(``mlp.experts.gate_up_proj`` ``[E, 2 * hidden, dim]``, ``mlp.experts.down_proj``). No
RoPE permutation is needed: both sides rotate adjacent channel pairs (``rope_interleave``).
Layers at or beyond ``n_layers`` (the multi-token-prediction module of the 671B
checkpoint) are skipped. Tensors are expected to be full (not sharded DTensors).

``to_hf_config``/``from_hf_config`` translate the model arguments to and from a
``config.json``; Hugging Face's router is sigmoid-only, so softmax-routed flavors (the
DeepSeek-V2-Lite-sized "16B") have no Hugging Face DeepseekV3 equivalent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.layers.moe import MoEArgs
from torchtitan.models.common.hf_keys import (
    DENSE_BLOCK,
    ROUTER,
    DecoderStateDictAdapter,
    check_same_fields,
    require,
    rope_settings,
)
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.tools.logging import logger

_MLA = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_MOE = ROUTER | {
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3": "mlp.shared_experts.up_proj.weight",
}


class DeepSeekV3StateDictAdapter(DecoderStateDictAdapter):
    """``to_hf``/``from_hf`` for :class:`~torchtitan.models.deepseek_v3.model.DeepSeekV3Model`."""

    model_args: DeepSeekV3ModelArgs
    family = "DeepSeek-V3"
    per_layer = _MLA | DENSE_BLOCK | _MOE

    def hf_config(self) -> dict[str, Any]:
        return to_hf_config(self.model_args)

    def check_hf_config(self, config: dict[str, Any]) -> None:
        self.require_architecture(config, "DeepseekV3ForCausalLM", "DeepSeek-V3")
        check_same_fields(
            _compared_fields(from_hf_config(config)), _compared_fields(self.model_args)
        )
        if self.model_args.moe.load_balance_coeff is None:
            logger.warning(
                "model.flavor has moe.load_balance_coeff = None, so the routers ignore the "
                "checkpoint's e_score_correction_bias (Hugging Face always adds it)"
            )

    def skips_hf_layer(self, layer: int) -> bool:
        """The multi-token-prediction module of the 671B checkpoint (layers beyond ours)."""
        return layer >= self.model_args.n_layers


def to_hf_config(args: DeepSeekV3ModelArgs) -> dict[str, Any]:
    """A ``transformers.DeepseekV3Config``-compatible dict for ``args``. Hugging Face's
    router is sigmoid-only, so softmax-routed flavors have no equivalent."""
    moe = args.moe
    if moe.score_func != "sigmoid":
        raise ValueError(
            f"this model routes with {moe.score_func} scores (moe.score_func) but Hugging Face "
            "DeepseekV3ForCausalLM only routes with sigmoid, so it has no Hugging Face "
            "equivalent; choose a sigmoid-routed flavor"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_factor > 1:
        rope.update(
            rope_type="yarn",
            factor=args.rope_factor,
            original_max_position_embeddings=args.rope_original_seq_len,
            beta_fast=args.rope_beta_fast,
            beta_slow=args.rope_beta_slow,
            mscale=args.rope_mscale,
            mscale_all_dim=args.rope_mscale,
        )
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers,
        "first_k_dense_replace": args.n_dense_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.num_shared_experts,
        "num_experts_per_tok": moe.top_k,
        "n_group": moe.num_expert_groups or 1,
        "topk_group": moe.num_limited_groups or 1,
        "norm_topk_prob": moe.route_norm,
        "routed_scaling_factor": moe.route_scale,
        "q_lora_rank": args.q_latent_rank or None,
        "kv_lora_rank": args.kv_latent_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_interleave": True,
        "rope_parameters": rope,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "num_nextn_predict_layers": 0,
    }


def from_hf_config(config: Mapping[str, Any]) -> DeepSeekV3ModelArgs:
    """Model args equivalent to a Hugging Face DeepSeek-V3 config dict (``max_seq_len`` is
    left at its default: the trainer sets it from ``training.seq_len``)."""
    if config.get("tie_word_embeddings", False):
        raise ValueError("config.json: tied word embeddings are not supported")
    if config.get("attention_bias", False):
        raise ValueError("config.json: attention biases are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: unsupported hidden_act {config['hidden_act']!r}")
    rope = rope_settings(config)
    if rope["rope_type"] not in ("default", "yarn"):
        raise ValueError(f"config.json: unsupported rope_type {rope['rope_type']!r}")
    groups = require(config, "n_group")
    limited = require(config, "topk_group")
    if groups == 1:  # one group: no group-limited routing
        groups = limited = None
    moe = MoEArgs(
        num_experts=require(config, "n_routed_experts"),
        num_shared_experts=require(config, "n_shared_experts"),
        top_k=require(config, "num_experts_per_tok"),
        score_func=config.get("scoring_func", "sigmoid"),
        route_norm=bool(require(config, "norm_topk_prob")),
        route_scale=float(require(config, "routed_scaling_factor")),
        num_expert_groups=groups,
        num_limited_groups=limited,
    )
    args = DeepSeekV3ModelArgs(
        vocab_size=require(config, "vocab_size"),
        dim=require(config, "hidden_size"),
        inter_dim=require(config, "intermediate_size"),
        moe_inter_dim=require(config, "moe_intermediate_size"),
        n_layers=require(config, "num_hidden_layers"),
        n_dense_layers=require(config, "first_k_dense_replace"),
        n_heads=require(config, "num_attention_heads"),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        moe=moe,
        q_latent_rank=config.get("q_lora_rank") or 0,  # null: full-rank queries
        kv_latent_rank=require(config, "kv_lora_rank"),
        qk_nope_head_dim=require(config, "qk_nope_head_dim"),
        qk_rope_head_dim=require(config, "qk_rope_head_dim"),
        v_head_dim=require(config, "v_head_dim"),
        rope_theta=float(rope["rope_theta"]),
    )
    if rope["rope_type"] == "yarn":
        mscale, mscale_all_dim = rope.get("mscale", 1.0), rope.get("mscale_all_dim", 0.0)
        if mscale != mscale_all_dim:
            raise ValueError(
                f"config.json: YaRN with mscale ({mscale}) != mscale_all_dim ({mscale_all_dim}) "
                "is not supported"
            )
        args.rope_factor = float(rope["factor"])
        args.rope_original_seq_len = int(rope["original_max_position_embeddings"])
        args.rope_beta_fast = float(rope.get("beta_fast", 32.0))
        args.rope_beta_slow = float(rope.get("beta_slow", 1.0))
        args.rope_mscale = float(mscale)
    return args


def _compared_fields(args: DeepSeekV3ModelArgs) -> dict[str, Any]:
    """What makes two configurations compute different functions (weight shapes, routing,
    RoPE), in comparable form."""
    moe = args.moe
    grouped = (moe.num_expert_groups or 1) > 1
    fields = {
        "n_layers": args.n_layers,
        "dim": args.dim,
        "n_heads": args.n_heads,
        "vocab_size": args.vocab_size,
        "inter_dim": args.inter_dim,
        "moe_inter_dim": args.moe_inter_dim,
        "n_dense_layers": args.n_dense_layers,
        "q_latent_rank": args.q_latent_rank or 0,
        "kv_latent_rank": args.kv_latent_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "moe.num_experts": moe.num_experts,
        "moe.num_shared_experts": moe.num_shared_experts,
        "moe.top_k": moe.top_k,
        "moe.score_func": moe.score_func,
        "moe.route_norm": moe.route_norm,
        "moe.route_scale": moe.route_scale,
        "moe.num_expert_groups": moe.num_expert_groups if grouped else None,
        "moe.num_limited_groups": moe.num_limited_groups if grouped else None,
        "rope_theta": args.rope_theta,
        "rope_factor": args.rope_factor if args.rope_factor > 1 else 1.0,
    }
    if args.rope_factor > 1:
        fields.update(
            rope_original_seq_len=args.rope_original_seq_len,
            rope_beta_fast=args.rope_beta_fast,
            rope_beta_slow=args.rope_beta_slow,
            rope_mscale=args.rope_mscale,
        )
    return fields
