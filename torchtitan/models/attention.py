"""The single seam through which every model computes attention.

Context parallelism (and any alternative kernel) replaces or wraps this one
module type instead of patching each model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ScaledDotProductAttention(nn.Module):
    """Causal scaled-dot-product attention.

    ``forward(q, k, v)`` takes ``[batch, heads, seq, head_dim]`` tensors where
    ``k`` and ``v`` already have as many heads as ``q`` (callers expand grouped
    KV heads first), so every SDPA backend and context-parallel implementation
    sees plain multi-head attention. Returns a tensor shaped like ``q``. ``scale``: the
    softmax scale, by default ``1 / sqrt(head_dim)``.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
