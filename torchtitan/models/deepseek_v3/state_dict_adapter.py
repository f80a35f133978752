"""Conversion between our DeepSeek-V3 checkpoints and Hugging Face ``DeepseekV3ForCausalLM``.

``to_hf`` writes the layout of the published safetensors files (and of transformers'
``save_pretrained``): one ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert.
``from_hf`` reads that layout and also transformers' in-memory fused one
(``mlp.experts.gate_up_proj`` ``[E, 2 * hidden, dim]``, ``mlp.experts.down_proj``). No
RoPE permutation is needed: both sides rotate adjacent channel pairs (``rope_interleave``).
Layers at or beyond ``n_layers`` (the multi-token-prediction module of the 671B
checkpoint) are skipped. Tensors are expected to be full (not sharded DTensors).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch

from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3": "mlp.shared_experts.up_proj.weight",
}
_EXPERTS = {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj", "moe.experts.w3": "up_proj"}
_TO_OURS_TOP = {hf: ours for ours, hf in _TOP_LEVEL.items()}
_TO_OURS_LAYER = {hf: ours for ours, hf in _PER_LAYER.items()}
_TO_OURS_EXPERT = {hf: ours for ours, hf in _EXPERTS.items()}
_OURS_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT_KEY = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class DeepSeekV3StateDictAdapter(StateDictAdapter):
    model_args: DeepSeekV3ModelArgs

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in state_dict.items():
            if key in _TOP_LEVEL:
                out[_TOP_LEVEL[key]] = value
                continue
            layer, rest = _split_layer_key(_OURS_LAYER_KEY, key)
            if rest in _EXPERTS:
                for e, expert in enumerate(value.unbind(0)):
                    out[f"model.layers.{layer}.mlp.experts.{e}.{_EXPERTS[rest]}.weight"] = expert
            elif rest in _PER_LAYER:
                out[f"model.layers.{layer}.{_PER_LAYER[rest]}"] = value
            else:
                raise ValueError(f"no Hugging Face counterpart for key {key!r}")
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
        for hf_key, value in hf_state_dict.items():
            if hf_key in _TO_OURS_TOP:
                out[_TO_OURS_TOP[hf_key]] = value
                continue
            layer, rest = _split_layer_key(_HF_LAYER_KEY, hf_key)
            if int(layer) >= self.model_args.n_layers:
                continue
            prefix = f"layers.{layer}."
            if expert := _HF_EXPERT_KEY.fullmatch(rest):
                experts[(layer, _TO_OURS_EXPERT[expert.group(2)])][int(expert.group(1))] = value
            elif rest == "mlp.experts.gate_up_proj":
                out[prefix + "moe.experts.w1"], out[prefix + "moe.experts.w3"] = value.chunk(2, dim=1)
            elif rest == "mlp.experts.down_proj":
                out[prefix + "moe.experts.w2"] = value
            elif rest in _TO_OURS_LAYER:
                out[prefix + _TO_OURS_LAYER[rest]] = value
            else:
                raise ValueError(f"unknown Hugging Face DeepSeek-V3 key {hf_key!r}")
        for (layer, name), by_index in experts.items():
            n = self.model_args.moe.num_experts
            if sorted(by_index) != list(range(n)):
                raise ValueError(
                    f"layer {layer}: expected experts 0..{n - 1} for {name}, got {sorted(by_index)}"
                )
            out[f"layers.{layer}.{name}"] = torch.stack([by_index[e] for e in range(n)])
        return out


def _split_layer_key(pattern: re.Pattern, key: str) -> tuple[str, str]:
    match = pattern.fullmatch(key)
    if match is None:
        raise ValueError(f"unknown key {key!r}")
    return match.group(1), match.group(2)


def to_hf_config(args: DeepSeekV3ModelArgs) -> dict[str, Any]:
    """A ``transformers.DeepseekV3Config``-compatible dict for ``args``. Hugging Face's
    router is sigmoid-only, so softmax-routed flavors have no equivalent."""
    moe = args.moe
    if moe.score_func != "sigmoid":
        raise ValueError(
            f"Hugging Face DeepseekV3 routes with sigmoid scores; this model uses {moe.score_func}"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_factor > 1:
        rope.update(
            rope_type="yarn", factor=args.rope_factor,
            original_max_position_embeddings=args.rope_original_seq_len,
            beta_fast=args.rope_beta_fast, beta_slow=args.rope_beta_slow,
            mscale=args.rope_mscale, mscale_all_dim=args.rope_mscale,
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
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
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
