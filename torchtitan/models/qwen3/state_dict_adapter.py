"""Conversion between our Qwen3 checkpoints and Hugging Face ``Qwen3ForCausalLM`` /
``Qwen3MoeForCausalLM`` (key tables: ``models/common/hf_keys.py``).

Besides renaming keys, the q/k projections and the per-head q/k norm weights are permuted
between our interleaved RoPE layout and Hugging Face's rotate-half one (pure re-indexing, so
round trips are bit-exact). Experts: one ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per
expert, as published. Tied embeddings: Hugging Face stores only ``model.embed_tokens.weight``
(an ``lm_head.weight`` present anyway is read as the output weight). The expert bias of
aux-loss-free balancing has no Hugging Face counterpart, so such flavors do not export.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.layers.moe import MoEArgs
from torchtitan.models.common.hf_keys import (
    DENSE_BLOCK,
    GQA,
    ROUTER,
    DecoderStateDictAdapter,
    check_same_fields,
    require,
    rope_settings,
)
from torchtitan.models.qwen3.args import Qwen3ModelArgs

_QK_NORMS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}


class Qwen3StateDictAdapter(DecoderStateDictAdapter):
    """``to_hf``/``from_hf`` for :class:`~torchtitan.models.qwen3.model.Qwen3Model`."""

    model_args: Qwen3ModelArgs
    family = "Qwen3"
    per_layer = GQA | _QK_NORMS | DENSE_BLOCK | ROUTER

    def hf_config(self) -> dict[str, Any]:
        return to_hf_config(self.model_args)

    def check_hf_config(self, config: dict[str, Any]) -> None:
        architecture = "Qwen3ForCausalLM" if self.model_args.moe is None else "Qwen3MoeForCausalLM"
        self.require_architecture(
            config, architecture, "Qwen3" if self.model_args.moe is None else "Qwen3-MoE"
        )
        check_same_fields(
            _compared_fields(from_hf_config(config)), _compared_fields(self.model_args)
        )

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = super().to_hf(state_dict)
        if self.model_args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = super().from_hf(hf_state_dict)
        if self.model_args.tie_word_embeddings and "tok_embeddings.weight" in out:
            out.setdefault("output.weight", out["tok_embeddings.weight"])
        return out

    def rope_heads(self, key: str) -> int | None:
        """How many heads' channels the RoPE permutation reorders in ``key``, or None."""
        args = self.model_args
        return {
            "attention.wq.weight": args.n_heads,
            "attention.wk.weight": args.n_kv_heads,
            "attention.q_norm.weight": 1,
            "attention.k_norm.weight": 1,
        }.get(key)


def to_hf_config(args: Qwen3ModelArgs) -> dict[str, Any]:
    """A ``transformers.Qwen3Config`` (or ``Qwen3MoeConfig``)-compatible dict for ``args``;
    RoPE settings in both the 5.x (``rope_parameters``) and 4.x (``rope_theta``) forms."""
    config: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_scaling": _rope_scaling(args),
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta}
        | (_rope_scaling(args) or {}),
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "use_sliding_window": False,
    }
    moe = args.moe
    if moe is None:
        return config
    if moe.load_balance_coeff is not None:
        raise ValueError(
            "this flavor balances experts with a learned expert bias (moe.load_balance_coeff), "
            "which Hugging Face Qwen3MoeForCausalLM does not have, so it has no Hugging Face "
            "equivalent; choose a flavor with moe.load_balance_coeff = None"
        )
    return config | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "norm_topk_prob": moe.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.0,
    }


def _rope_scaling(args: Qwen3ModelArgs) -> dict[str, Any] | None:
    """The YaRN settings in config.json form, or None without YaRN."""
    if args.rope_factor <= 1:
        return None
    scaling = {
        "rope_type": "yarn",
        "factor": args.rope_factor,
        "original_max_position_embeddings": args.rope_original_seq_len,
        "beta_fast": args.rope_beta_fast,
        "beta_slow": args.rope_beta_slow,
    }
    if args.rope_attention_factor is not None:
        scaling["attention_factor"] = args.rope_attention_factor
    return scaling


def _read_yarn(config: Mapping[str, Any], args: Qwen3ModelArgs) -> None:
    """Set ``args``' YaRN fields from config.json's RoPE settings (rope_type "yarn"; the
    original context defaults to max_position_embeddings, as in transformers)."""
    rope = rope_settings(config)
    if rope.get("mscale") or rope.get("mscale_all_dim"):
        raise ValueError(
            "config.json: YaRN with mscale / mscale_all_dim is not supported for Qwen3; "
            "give attention_factor instead"
        )
    args.rope_factor = float(require(rope, "factor"))
    args.rope_original_seq_len = int(
        rope.get("original_max_position_embeddings") or require(config, "max_position_embeddings")
    )
    args.rope_beta_fast = float(rope.get("beta_fast") or 32.0)
    args.rope_beta_slow = float(rope.get("beta_slow") or 1.0)
    if rope.get("attention_factor") is not None:
        args.rope_attention_factor = float(rope["attention_factor"])


def from_hf_config(config: Mapping[str, Any]) -> Qwen3ModelArgs:
    """Model args equivalent to a Hugging Face Qwen3 or Qwen3-MoE config dict
    (``max_seq_len`` is left at its default: the trainer sets it from ``training.seq_len``)."""
    _reject_unsupported(config)
    rope = rope_settings(config)
    n_heads = require(config, "num_attention_heads")
    args = Qwen3ModelArgs(
        vocab_size=require(config, "vocab_size"),
        dim=require(config, "hidden_size"),
        n_layers=require(config, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        ffn_hidden_dim=require(config, "intermediate_size"),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope["rope_theta"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    if rope["rope_type"] == "yarn":
        _read_yarn(config, args)
    if num_experts := _num_experts(config):
        args.moe = MoEArgs(
            num_experts=num_experts,
            num_shared_experts=0,
            top_k=require(config, "num_experts_per_tok"),
            score_func="softmax",
            route_norm=bool(config.get("norm_topk_prob", False)),
            route_scale=1.0,
            load_balance_coeff=None,
        )
        args.moe_hidden_dim = require(config, "moe_intermediate_size")
    return args


def _num_experts(config: Mapping[str, Any]) -> int | None:
    """Routed experts (config.json says ``num_experts``; transformers' ``to_dict`` its alias
    ``num_local_experts``); None for a dense model."""
    return config.get("num_experts") or config.get("num_local_experts")


def _reject_unsupported(config: Mapping[str, Any]) -> None:
    """One line naming the first config.json field this model cannot express."""
    rope_type = rope_settings(config)["rope_type"]
    problems = [
        (config.get("attention_bias"), "attention biases are not supported"),
        (
            config.get("hidden_act", "silu") != "silu",
            f"unsupported hidden_act {config.get('hidden_act')!r}",
        ),
        (
            config.get("use_sliding_window"),
            "sliding-window layers (use_sliding_window) are not supported",
        ),
        (rope_type not in ("default", "yarn"), f"unsupported rope_type {rope_type!r}"),
        (
            _num_experts(config) and config.get("mlp_only_layers"),
            "dense layers among MoE layers (mlp_only_layers) are not supported",
        ),
        (
            _num_experts(config) and config.get("decoder_sparse_step", 1) != 1,
            "MoE in only some layers (decoder_sparse_step != 1) is not supported",
        ),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(f"config.json: {message}")


def _compared_fields(args: Qwen3ModelArgs) -> dict[str, Any]:
    """What makes two configurations compute different functions, in comparable form."""
    fields = {
        "n_layers": args.n_layers,
        "dim": args.dim,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": _rope_scaling(args),
        "tie_word_embeddings": args.tie_word_embeddings,
        "moe": args.moe is not None,
    }
    if args.moe is None:
        return fields | {"ffn_hidden_dim": args.ffn_hidden_dim}
    return fields | {
        "moe.num_experts": args.moe.num_experts,
        "moe.top_k": args.moe.top_k,
        "moe.route_norm": args.moe.route_norm,
        "moe_hidden_dim": args.moe_hidden_dim,
    }
