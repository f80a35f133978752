"""Qwen3.5 (text): the shared decoder (``layers/decoder.py``) whose blocks mix tokens with
either Gated DeltaNet (``layers/gated_deltanet.py``) or gated grouped-query attention (q/k
norms, partial RoPE, a sigmoid gate per output channel), by ``layer_types``; every norm is
zero-centred (``layers/norms.py``); the feed-forward is a dense SwiGLU or a MoE with a gated
shared expert.

Hugging Face rotates channel ``i`` with ``i + rotary_dim / 2`` within the rotary part; we
rotate adjacent pairs like every model here, and the state-dict adapter permutes the rotary
rows of the q/k projections and norms."""

from __future__ import annotations

import re

import torch
from torch import nn

from torchtitan.layers.decoder import Decoder, InitRules, TransformerBlock
from torchtitan.layers.feed_forward import FeedForward
from torchtitan.layers.gated_deltanet import GatedDeltaNet
from torchtitan.layers.gqa import GQAttention
from torchtitan.layers.moe import MoE
from torchtitan.layers.norms import ZeroCenteredRMSNorm
from torchtitan.layers.rope import rope_frequencies
from torchtitan.models.qwen3_5.args import DELTA_RULE, Qwen3_5ModelArgs

_FFNS = r"(feed_forward|moe\.experts|moe\.shared_experts)"
_INIT_RULES = InitRules(
    plain=re.compile(
        rf"attention\.(wq|wk|wv|q_proj|k_proj|v_proj|z_proj|a_proj|b_proj)\.weight|"
        rf"{_FFNS}\.w1(\.weight)?|moe\.router\.gate\.weight|moe\.shared_gate\.weight"
    ),
    depth_scaled=re.compile(rf"attention\.(wo|out_proj)\.weight|{_FFNS}\.(w2|w3)(\.weight)?"),
)


def rope_inv_freq(args: Qwen3_5ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """``[rotary_dim // 2]`` fp32 inverse frequencies of the rotated channels."""
    return rope_frequencies(args.rotary_dim, args.rope_theta, device)


def build_mixer(args: Qwen3_5ModelArgs, layer: int) -> nn.Module:
    if args.layer_types[layer] == DELTA_RULE:
        return GatedDeltaNet(
            args.dim,
            args.delta_rule_n_k_heads,
            args.delta_rule_n_v_heads,
            args.delta_rule_k_head_dim,
            args.delta_rule_v_head_dim,
            args.delta_rule_conv_kernel,
            args.norm_eps,
            chunk_size=args.delta_rule_chunk_size,
            block_causal=args.mask_spec.block_causal,
        )
    return GQAttention(
        args.dim,
        args.n_heads,
        args.n_kv_heads,
        args.head_dim,
        args.attn_type,
        args.mask_spec,
        qk_norm_eps=args.norm_eps,
        output_gate=True,
        qk_norm=ZeroCenteredRMSNorm,
    )


def build_block(args: Qwen3_5ModelArgs, layer: int) -> TransformerBlock:
    if args.moe is not None:
        ffn: nn.Module = MoE(args.dim, args.moe_hidden_dim, args.moe, args.shared_expert_hidden_dim)
    else:
        ffn = FeedForward(args.dim, args.ffn_hidden_dim)
    return TransformerBlock(
        args.dim, args.norm_eps, build_mixer(args, layer), ffn, norm=ZeroCenteredRMSNorm
    )


class Qwen3_5Model(Decoder):
    """Qwen3.5 decoder (see :class:`~torchtitan.layers.decoder.Decoder`)."""

    def __init__(self, model_args: Qwen3_5ModelArgs) -> None:
        super().__init__(
            model_args,
            {str(i): build_block(model_args, i) for i in range(model_args.n_layers)},
            rope_frequencies=rope_inv_freq,
            init_rules=_INIT_RULES,
            tie_word_embeddings=model_args.tie_word_embeddings,
            depth_init=model_args.depth_init,
            norm=ZeroCenteredRMSNorm,
        )
