"""Grouped-query attention with RoPE around the attention seam (``layers/attention.py``).

Queries, keys and values come from ``wq``/``wk``/``wv``; with ``qk_norm_eps`` set, each
query and key head is RMS-normalised over its channels before RoPE (Qwen3). gpt-oss adds
biases to the four projections and a learned attention sink per head (``sinks``). Qwen3.5
gates the output (``output_gate``: ``wq`` yields each head's query followed by as many gate
logits, and the attention output is multiplied by their sigmoid) and rotates only the first
channels of each head (partial RoPE: as many as the RoPE table is wide). Head
counts are read from the projections' outputs at run time, so tensor parallel can shard
heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan.layers.attention import MaskSpec, build_attention
from torchtitan.layers.decoder import NormFactory
from torchtitan.layers.moe import local
from torchtitan.layers.rope import apply_rope


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, s, kv_heads, d] -> [b, s, kv_heads * n_rep, d]``; query head ``j`` then uses KV
    head ``j // n_rep``."""
    if n_rep == 1:
        return x
    b, s, kv_heads, d = x.shape
    return x.unsqueeze(3).expand(b, s, kv_heads, n_rep, d).reshape(b, s, kv_heads * n_rep, d)


def rotate(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """RoPE on the first ``table.shape[-1]`` channels of each head (all of them unless the
    model rotates only part, as Qwen3.5 does); the rest pass unchanged."""
    rotary = table.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rope(x, table, positions)
    return torch.cat([apply_rope(x[..., :rotary], table, positions), x[..., rotary:]], dim=-1)


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
        output_gate: bool = False,
        qk_norm: NormFactory = nn.RMSNorm,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.softmax_scale = softmax_scale  # None: head_dim ** -0.5
        self.output_gate = output_gate
        query_width = 2 * head_dim if output_gate else head_dim
        self.wq = nn.Linear(dim, n_heads * query_width, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        # one logit per (query) head in every softmax's denominator (layers/attention.py)
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = qk_norm(head_dim, eps=qk_norm_eps)
            self.k_norm = qk_norm(head_dim, eps=qk_norm_eps)
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
        xq = self.wq(x)
        if self.output_gate:
            xq, gate = xq.view(bsz, seq_len, -1, 2 * self.head_dim).chunk(2, dim=-1)
        xq = xq.reshape(bsz, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        if self.qk_norm:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = rotate(xq, rope_cache, positions), rotate(xk, rope_cache, positions)
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
        out = out.transpose(1, 2)
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(bsz, seq_len, -1))
