"""Qwen3 and Qwen3-MoE: the shared decoder (``models/common``) with grouped-query attention
whose query and key heads are RMS-normalised over their channels before RoPE (theta 1e6),
a dense SwiGLU or a MoE feed-forward in every block, and optionally tied embeddings.

Hugging Face's Qwen3 rotates channel ``i`` with ``i + head_dim / 2``; we rotate adjacent
pairs like every model here, and the state-dict adapter permutes the q/k projections and
the q/k norm weights (RMSNorm commutes with a channel permutation of its weight)."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.layers.decoder import Decoder, InitRules, TransformerBlock
from torchtitan.layers.feed_forward import FeedForward
from torchtitan.layers.gqa import GQAttention
from torchtitan.layers.moe import MoE
from torchtitan.layers.rope import rope_frequencies, yarn_scaled
from torchtitan.models.qwen3.args import Qwen3ModelArgs

_INIT_RULES = InitRules.for_attention(("wq", "wk", "wv"))


def rope_inv_freq(args: Qwen3ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """``[head_dim // 2]`` fp32 inverse frequencies, YaRN-scaled when ``rope_factor > 1``."""
    inv_freq = rope_frequencies(args.head_dim, args.rope_theta, device)
    if args.rope_factor <= 1:
        return inv_freq
    return yarn_scaled(
        inv_freq,
        args.head_dim,
        args.rope_theta,
        args.rope_factor,
        args.rope_original_seq_len,
        args.rope_beta_fast,
        args.rope_beta_slow,
    )


def build_block(args: Qwen3ModelArgs) -> TransformerBlock:
    attention = GQAttention(
        args.dim,
        args.n_heads,
        args.n_kv_heads,
        args.head_dim,
        args.attn_type,
        args.mask_spec,
        qk_norm_eps=args.norm_eps,
        softmax_scale=args.softmax_scale,
    )
    if args.moe is not None:
        ffn: nn.Module = MoE(args.dim, args.moe_hidden_dim, args.moe)
    else:
        ffn = FeedForward(args.dim, args.ffn_hidden_dim)
    return TransformerBlock(args.dim, args.norm_eps, attention, ffn)


class Qwen3Model(Decoder):
    """Qwen3 decoder (see :class:`~torchtitan.layers.decoder.Decoder`)."""

    def __init__(self, model_args: Qwen3ModelArgs) -> None:
        super().__init__(
            model_args,
            {str(i): build_block(model_args) for i in range(model_args.n_layers)},
            rope_frequencies=rope_inv_freq,
            init_rules=_INIT_RULES,
            tie_word_embeddings=model_args.tie_word_embeddings,
            depth_init=model_args.depth_init,
        )
