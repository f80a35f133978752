"""Grouped-query attention with RoPE around the attention seam (``layers/attention.py``).

Queries, keys and values come from ``wq``/``wk``/``wv``; with ``qk_norm_eps`` set, each
query and key head is RMS-normalised over its channels before RoPE (Qwen3). gpt-oss adds
biases to the four projections and a learned attention sink per head (``sinks``). Head
counts are read from the projections' outputs at run time, so tensor parallel can shard
heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan.layers.attention import MaskSpec, build_attention
from torchtitan.layers.moe import local
from torchtitan.layers.rope import apply_rotary_emb


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, s, kv_heads, d] -> [b, s, kv_heads * n_rep, d]``; query head ``j`` then uses KV
    head ``j // n_rep``."""
    if n_rep == 1:
        return x
    b, s, kv_heads, d = x.shape
    return x.unsqueeze(3).expand(b, s, kv_heads, n_rep, d).reshape(b, s, kv_heads * n_rep, d)


class GQAttention(nn.Module):
    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        attn_type: str,
        mask_spec: MaskSpec,
        qk_norm_eps: float | None = None,
        softmax_scale: float | None = None,
        bias: bool = False,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.softmax_scale = softmax_scale  # None: head_dim ** -0.5
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        # one logit per (query) head in every softmax's denominator (layers/attention.py)
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.inner_attention = build_attention(attn_type, mask_spec)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        """``mask``: the batch's prepared attention mask (``layers/attention.py``)."""
        bsz, seq_len, _ = x.shape
        xq = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        if self.qk_norm:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary_emb(xq, xk, rope_cache, positions)
        n_rep = xq.shape[2] // xk.shape[2]
        xk, xv = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
        out = self.inner_attention(
            xq.transpose(1, 2),
            xk.transpose(1, 2),
            xv.transpose(1, 2),
            mask=mask,
            scale=self.softmax_scale,
            sinks=None if self.sinks is None else local(self.sinks),
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))
