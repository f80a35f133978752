"""Zero-centred RMSNorm (Qwen3.5, Qwen3-Next, Gemma): ``rmsnorm(x) * (1 + weight)`` with the
weight starting at zero, normalised and scaled in fp32. Stored as the offset, as in their
checkpoints, so that loading and exporting is bit-exact (``1 + w - 1`` is not ``w`` in
floating point)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.layers.init import zeros_init


class ZeroCenteredRMSNorm(nn.Module):
    """Drop-in for ``nn.RMSNorm(dim, eps)`` whose scale is ``1 + weight``."""

    param_init_fns = {"weight": zeros_init}

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
