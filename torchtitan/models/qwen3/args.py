"""Arguments of the Qwen3 model family: dense (``moe`` None) and Qwen3-MoE (every block's
feed-forward a MoE layer of ``moe.num_experts`` routed experts, no shared experts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from torchtitan.layers.moe import MoEArgs
from torchtitan.layers.rope import yarn_mscale
from torchtitan.models.common.args import (
    check_expert_layout,
    check_no_experts,
    check_tp_divides_heads,
    nparams_and_flops,
    require,
)
from torchtitan.protocols.geometry import Experts, Geometry
from torchtitan.protocols.model import BaseModelArgs

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims


@dataclass
class Qwen3ModelArgs(BaseModelArgs):
    vocab_size: int = 151936
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    # Set on its own: n_heads * head_dim need not equal dim (Qwen3-0.6B: 16 x 128 vs 1024).
    head_dim: int = 128
    ffn_hidden_dim: int = 12288  # dense SwiGLU hidden size (Hugging Face intermediate_size)
    norm_eps: float = 1e-6  # every RMSNorm, the per-head q/k norms included
    rope_theta: float = 1_000_000.0
    # YaRN context extension (config.json rope_type "yarn"), on when rope_factor > 1: the
    # frequencies are YaRN-scaled (layers/rope.py) and attention logits multiplied by
    # rope_attention_factor ** 2, as Hugging Face's cos and sin scaled by it do (None: YaRN's
    # default 0.1 ln(rope_factor) + 1).
    rope_factor: float = 1.0
    rope_original_seq_len: int = 32768
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float | None = None
    max_seq_len: int = 4096
    # The output layer uses the embedding's weight (the published 0.6B, 1.7B and 4B).
    tie_word_embeddings: bool = False
    # Qwen3-MoE: softmax top-k routing with renormalised top-k weights (route_norm);
    # load_balance_coeff None routes as the published models (no expert bias).
    moe: MoEArgs | None = None
    moe_hidden_dim: int = 768  # one expert's hidden size (moe_intermediate_size)
    # Scale the std of output projections by layer depth (else by n_layers).
    depth_init: bool = True

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def softmax_scale(self) -> float | None:
        """None (attention's default) without YaRN."""
        if self.rope_factor <= 1:
            return None
        factor = self.rope_attention_factor
        if factor is None:
            factor = yarn_mscale(self.rope_factor, 1.0)
        return self.head_dim**-0.5 * factor**2

    def check_parallelism(self, parallel_dims: ParallelDims) -> None:
        check_tp_divides_heads(parallel_dims.tp, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads)
        if self.moe is None:
            check_no_experts(parallel_dims, "this qwen3 flavor (dense)")
        else:
            check_expert_layout(parallel_dims, self.moe, {"moe_hidden_dim": self.moe_hidden_dim})
        require(
            not (self.tie_word_embeddings and parallel_dims.pp > 1),
            "parallelism.pipeline_parallel_degree: this qwen3 flavor ties the output layer to the "
            "embedding, which sit on different pipeline stages; use pipeline_parallel_degree 1 "
            "or an untied flavor (8B and larger)",
        )

    def geometry(self) -> Geometry:
        """Queries and keys RMS-normalised per head; a MoE flavor's ``ffn_hidden_dim`` (Hugging
        Face's intermediate_size) counts as the dense feed-forward's width."""
        return Geometry(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            ffn_dim=self.ffn_hidden_dim,
            vocab_size=self.vocab_size,
            qk_norm=True,
            tied_embeddings=self.tie_word_embeddings,
            experts=None if self.moe is None else Experts.from_moe(self.moe, self.moe_hidden_dim),
        )

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameter count and training FLOPs per token (``common/args.py``); attention adds
        ``12 * n_layers * n_heads * head_dim * seq_len``."""
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return nparams_and_flops(model, attention, self.moe, self.tie_word_embeddings)
