"""Arguments of the Llama 3 model family."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from torchtitan.models.common.args import (
    check_no_experts,
    check_tp_divides_heads,
    nparams_and_flops,
)
from torchtitan.protocols.geometry import Geometry
from torchtitan.protocols.model import BaseModelArgs

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims


@dataclass
class TransformerModelArgs(BaseModelArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 RoPE frequency scaling ("llama3" rope type in Hugging Face).
    use_scaled_rope: bool = False
    rope_scale_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    max_seq_len: int = 131072
    # Scale the std of output projections by layer depth (else by n_layers).
    depth_init: bool = True

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def check_parallelism(self, parallel_dims: ParallelDims) -> None:
        check_no_experts(parallel_dims, "llama3")
        check_tp_divides_heads(parallel_dims.tp, n_heads=self.n_heads, n_kv_heads=self.kv_heads)

    def geometry(self) -> Geometry:
        return Geometry(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            ffn_dim=self.ffn_hidden_dim,
            vocab_size=self.vocab_size,
        )

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameter count and training FLOPs per token (``common/args.py``); attention adds
        ``12 * n_layers * n_heads * head_dim * seq_len``."""
        return nparams_and_flops(model, 12 * self.n_layers * self.n_heads * self.head_dim * seq_len)
