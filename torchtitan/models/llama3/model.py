"""The Llama 3 transformer: the shared decoder (``models/common``) with grouped-query
attention, SwiGLU feed-forward and RoPE (Llama 3.1 frequency scaling on request)."""

from __future__ import annotations

import torch

from torchtitan.layers.decoder import Decoder, InitRules, TransformerBlock
from torchtitan.layers.feed_forward import FeedForward
from torchtitan.layers.gqa import GQAttention
from torchtitan.layers.rope import apply_rotary_emb, llama3_scaled, rope_frequencies, rope_table
from torchtitan.models.llama3.args import TransformerModelArgs

__all__ = ["Transformer", "apply_rotary_emb", "precompute_rope_cache", "rope_inv_freq"]

_INIT_RULES = InitRules.for_attention(("wq", "wk", "wv"))


def rope_inv_freq(args: TransformerModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` in fp32, Llama 3.1-scaled when
    ``args.use_scaled_rope``."""
    inv_freq = rope_frequencies(args.head_dim, args.rope_theta, device)
    if not args.use_scaled_rope:
        return inv_freq
    return llama3_scaled(
        inv_freq,
        args.rope_scale_factor,
        args.rope_low_freq_factor,
        args.rope_high_freq_factor,
        args.rope_original_max_position_embeddings,
    )


def precompute_rope_cache(
    args: TransformerModelArgs, device: torch.device | None = None
) -> torch.Tensor:
    """``[max_seq_len, head_dim]`` fp32 table: cos in the first half, sin in the second."""
    return rope_table(rope_inv_freq(args, device), args.max_seq_len)


def build_block(args: TransformerModelArgs) -> TransformerBlock:
    attention = GQAttention(
        args.dim, args.n_heads, args.kv_heads, args.head_dim, args.attn_type, args.mask_spec
    )
    return TransformerBlock(
        args.dim, args.norm_eps, attention, FeedForward(args.dim, args.ffn_hidden_dim)
    )


class Transformer(Decoder):
    """Llama 3 decoder (see :class:`~torchtitan.layers.decoder.Decoder`)."""

    def __init__(self, model_args: TransformerModelArgs) -> None:
        super().__init__(
            model_args,
            {str(i): build_block(model_args) for i in range(model_args.n_layers)},
            rope_frequencies=rope_inv_freq,
            init_rules=_INIT_RULES,
            depth_init=model_args.depth_init,
        )
