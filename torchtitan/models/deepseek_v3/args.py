"""Arguments of the DeepSeek-V3 model family (MLA attention, MoE feed-forward)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from torchtitan.layers.moe import MoEArgs
from torchtitan.layers.rope import yarn_mscale
from torchtitan.models.common.args import (
    check_expert_layout,
    check_tp_divides_heads,
    nparams_and_flops,
    require,
)
from torchtitan.protocols.geometry import Experts, Geometry, LatentAttention
from torchtitan.protocols.model import BaseModelArgs

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims


@dataclass
class DeepSeekV3ModelArgs(BaseModelArgs):
    vocab_size: int = 102400
    dim: int = 2048
    inter_dim: int = 10944  # hidden size of the dense FFNs
    moe_inter_dim: int = 1408  # hidden size of one expert
    n_layers: int = 27
    n_dense_layers: int = 1  # the first n_dense_layers blocks have a dense FFN, the rest MoE
    n_heads: int = 16
    norm_eps: float = 1e-6
    moe: MoEArgs = field(default_factory=MoEArgs)
    # Multi-head latent attention: 0 = queries from one full-rank projection.
    q_latent_rank: int = 0
    kv_latent_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE on the qk_rope_head_dim channels; rope_factor > 1 turns on YaRN (as in the
    # published checkpoints and Hugging Face: regardless of the sequence length).
    rope_theta: float = 10000.0
    rope_factor: float = 1.0
    rope_original_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    max_seq_len: int = 4096

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * yarn_mscale(self.rope_factor, self.rope_mscale) ** 2

    def check_parallelism(self, parallel_dims: ParallelDims) -> None:
        check_tp_divides_heads(parallel_dims.tp, n_heads=self.n_heads, inter_dim=self.inter_dim)
        check_expert_layout(
            parallel_dims,
            self.moe,
            {
                "moe_inter_dim": self.moe_inter_dim,
                "shared": self.moe_inter_dim * self.moe.num_shared_experts,
            },
        )
        if self.moe.num_expert_groups:
            require(
                self.moe.num_experts % self.moe.num_expert_groups == 0,
                f"model: num_expert_groups ({self.moe.num_expert_groups}) must divide "
                f"num_experts ({self.moe.num_experts})",
            )

    def geometry(self) -> Geometry:
        """Latent attention (every head its own keys and values), a dense feed-forward in the
        first ``n_dense_layers`` blocks, MoE with shared experts in the others."""
        return Geometry(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_heads,
            head_dim=self.qk_head_dim,
            ffn_dim=self.inter_dim,
            vocab_size=self.vocab_size,
            experts=Experts.from_moe(self.moe, self.moe_inter_dim, self.n_dense_layers),
            mla=LatentAttention(
                self.q_latent_rank, self.kv_latent_rank, self.qk_rope_head_dim, self.v_head_dim
            ),
        )

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameter count and training FLOPs per token (``common/args.py``); attention adds
        ``6 * n_layers * n_heads * (qk_head_dim + v_head_dim) * seq_len``."""
        attention = (
            6 * self.n_layers * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
        )
        return nparams_and_flops(model, attention, self.moe)
