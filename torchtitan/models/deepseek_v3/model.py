"""The DeepSeek-V3 decoder: multi-head latent attention (MLA) with decoupled RoPE, dense
feed-forward in the first ``n_dense_layers`` blocks and mixture-of-experts in the rest.

MLA: queries come from ``wq`` (or the low-rank ``wq_a`` -> ``q_norm`` -> ``wq_b``); keys
and values from one compressed latent (``wkv_a`` -> ``kv_norm`` -> ``wkv_b``). Only
``qk_rope_head_dim`` channels per head carry position: the queries' own, and one key
shared by all heads that ``wkv_a`` produces beside the latent. RoPE rotates adjacent
channel pairs ``(2i, 2i + 1)`` at frequency ``i`` (Hugging Face's ``rope_interleave``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.layers.attention import build_attention
from torchtitan.layers.decoder import Decoder, InitRules, TransformerBlock
from torchtitan.layers.feed_forward import FeedForward
from torchtitan.layers.moe import MoE
from torchtitan.layers.rope import apply_rope, rope_frequencies, yarn_scaled
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs

_INIT_RULES = InitRules.for_attention(("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"))


def rope_inv_freq(args: DeepSeekV3ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """``[qk_rope_head_dim // 2]`` fp32 inverse frequencies, YaRN-scaled when
    ``rope_factor > 1``."""
    inv_freq = rope_frequencies(args.qk_rope_head_dim, args.rope_theta, device)
    if args.rope_factor <= 1:
        return inv_freq
    return yarn_scaled(
        inv_freq,
        args.qk_rope_head_dim,
        args.rope_theta,
        args.rope_factor,
        args.rope_original_seq_len,
        args.rope_beta_fast,
        args.rope_beta_slow,
    )


class MLA(nn.Module):
    """Multi-head latent attention. Head counts come from the projections' outputs, so
    tensor parallel can shard heads (``wq``/``wq_b``/``wkv_b`` column-wise)."""

    def __init__(self, args: DeepSeekV3ModelArgs) -> None:
        super().__init__()
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.kv_latent_rank = args.kv_latent_rank
        q_out = args.n_heads * args.qk_head_dim
        if args.q_latent_rank == 0:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_latent_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_latent_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_latent_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_latent_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_latent_rank, eps=args.norm_eps)
        kv_out = args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
        self.wkv_b = nn.Linear(args.kv_latent_rank, kv_out, bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.softmax_scale = args.softmax_scale
        self.inner_attention = build_attention(args.attn_type, args.mask_spec)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        """``mask``: the batch's prepared attention mask (``layers/attention.py``)."""
        bsz, seq_len, _ = x.shape
        q = self._queries(x).view(bsz, seq_len, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_latent_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seq_len, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        n_heads = kv.shape[2]
        q_rope = apply_rope(q_rope, rope_cache, positions)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope_cache, positions).expand(-1, -1, n_heads, -1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        # Values padded to the query/key head size: every SDPA backend (and context
        # parallel) then sees plain equal-size multi-head attention.
        v = F.pad(v, (0, q.shape[-1] - self.v_dim))
        out = self.inner_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            mask=mask,
            scale=self.softmax_scale,
        )
        out = out.transpose(1, 2)[..., : self.v_dim].reshape(bsz, seq_len, -1)
        return self.wo(out)


def build_block(layer_id: int, args: DeepSeekV3ModelArgs) -> TransformerBlock:
    """MLA, then a dense FFN in the first ``n_dense_layers`` blocks and MoE in the rest."""
    if layer_id >= args.n_dense_layers:
        ffn: nn.Module = MoE(args.dim, args.moe_inter_dim, args.moe)
    else:
        ffn = FeedForward(args.dim, args.inter_dim)
    return TransformerBlock(args.dim, args.norm_eps, MLA(args), ffn)


class DeepSeekV3Model(Decoder):
    """DeepSeek-V3 decoder (see :class:`~torchtitan.layers.decoder.Decoder`)."""

    def __init__(self, model_args: DeepSeekV3ModelArgs) -> None:
        super().__init__(
            model_args,
            {str(i): build_block(i, model_args) for i in range(model_args.n_layers)},
            rope_frequencies=rope_inv_freq,
            init_rules=_INIT_RULES,
        )
