"""gpt-oss: the shared decoder (``models/common``) with grouped-query attention whose four
projections have biases and whose softmax has a learned sink per head, sliding-window and
full-attention layers alternating (``layer_types``), YaRN RoPE (theta 150,000, factor 32, its
ramp not rounded) and a MoE feed-forward in every block.

Sliding layers always run the FlexAttention kernel (the only one with windows: compiled on
CUDA, block by block on the CPU); full layers run ``model.attn_type``'s. Hugging Face's
gpt-oss rotates channel ``i`` with ``i + head_dim / 2``; we rotate adjacent pairs like every
model here, and the state-dict adapter permutes the q/k projections and their biases."""

from __future__ import annotations

import re

import torch

from torchtitan.layers.decoder import Decoder, InitRules, TransformerBlock
from torchtitan.layers.gqa import GQAttention
from torchtitan.layers.moe import MoE
from torchtitan.layers.rope import rope_frequencies, yarn_scaled
from torchtitan.models.gpt_oss.args import SLIDING, GptOssModelArgs

_INIT_RULES = InitRules(
    plain=re.compile(
        r"attention\.(wq|wk|wv)\.weight|attention\.sinks|moe\.experts\.w1|"
        r"moe\.router\.gate\.(weight|bias)"
    ),
    depth_scaled=re.compile(r"attention\.wo\.weight|moe\.experts\.(w2|w3)"),
    zeros=re.compile(r"attention\.(wq|wk|wv|wo)\.bias|moe\.experts\.(b1|b2|b3)"),
)


def rope_inv_freq(args: GptOssModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """``[head_dim // 2]`` fp32 YaRN-scaled inverse frequencies."""
    return yarn_scaled(
        rope_frequencies(args.head_dim, args.rope_theta, device),
        args.head_dim,
        args.rope_theta,
        args.rope_factor,
        args.rope_original_seq_len,
        args.rope_beta_fast,
        args.rope_beta_slow,
        truncate=args.rope_truncate,
    )


def build_block(args: GptOssModelArgs, layer: int) -> TransformerBlock:
    attention = GQAttention(
        args.dim,
        args.n_heads,
        args.n_kv_heads,
        args.head_dim,
        "flex" if args.layer_types[layer] == SLIDING else args.attn_type,
        args.layer_mask(layer),
        softmax_scale=args.softmax_scale,
        bias=True,
        sinks=True,
    )
    ffn = MoE(args.dim, args.moe_hidden_dim, args.moe)
    return TransformerBlock(args.dim, args.norm_eps, attention, ffn)


class GptOssModel(Decoder):
    """gpt-oss decoder (see :class:`~torchtitan.layers.decoder.Decoder`)."""

    def __init__(self, model_args: GptOssModelArgs) -> None:
        super().__init__(
            model_args,
            {str(i): build_block(model_args, i) for i in range(model_args.n_layers)},
            rope_frequencies=rope_inv_freq,
            init_rules=_INIT_RULES,
            depth_init=model_args.depth_init,
        )
