"""Arguments of gpt-oss: grouped-query attention with biases and a learned sink per head,
layers that alternate a sliding window with full causal attention, YaRN RoPE, and a MoE
feed-forward in every block (biased top-k router, experts with biases and a clamped
SwiGLU)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from torch import nn

from torchtitan.layers.attention import MaskSpec
from torchtitan.layers.moe import MoEArgs
from torchtitan.layers.rope import yarn_mscale
from torchtitan.models.common.args import (
    check_expert_layout,
    check_tp_divides_heads,
    nparams_and_flops,
    require,
)
from torchtitan.protocols.geometry import Experts, Geometry
from torchtitan.protocols.model import BaseModelArgs

if TYPE_CHECKING:
    from torchtitan.config import ModelConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.tokenizer import BaseTokenizer

SLIDING, FULL = "sliding_attention", "full_attention"


def gpt_oss_moe(num_experts: int, top_k: int) -> MoEArgs:
    """gpt-oss routing and experts: softmax over the top-k of the biased router's logits,
    no shared experts, no expert-bias balancing (as published), experts with biases and the
    SwiGLU clamped at 7 (alpha 1.702)."""
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        top_k=top_k,
        score_func="topk_softmax",
        router_bias=True,
        load_balance_coeff=None,
        expert_biases=True,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
    )


@dataclass
class GptOssModelArgs(BaseModelArgs):
    vocab_size: int = 201088
    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    norm_eps: float = 1e-5
    # Each layer's attention (config.json layer_types); empty: sliding first, alternating.
    layer_types: list[str] = field(default_factory=list)
    # The sliding layers' window (config.json sliding_window; the job's model.sliding_window,
    # one window for every layer, does not apply to gpt-oss).
    attention_window: int = 128
    rope_theta: float = 150_000.0
    # YaRN (always on in the published models), its ramp not rounded to whole channels
    rope_factor: float = 32.0
    rope_original_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = False
    max_seq_len: int = 4096
    moe: MoEArgs = field(default_factory=lambda: gpt_oss_moe(32, 4))
    moe_hidden_dim: int = 2880
    depth_init: bool = True

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(self.n_layers)]

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def softmax_scale(self) -> float:
        """YaRN's attention temperature squared (Hugging Face scales cos and sin by it)."""
        return self.head_dim**-0.5 * yarn_mscale(self.rope_factor, 1.0) ** 2

    def layer_mask(self, layer: int) -> MaskSpec:
        """Layer ``layer``'s mask: the model's (``block_causal`` or not), windowed on
        sliding layers."""
        window = self.attention_window if self.layer_types[layer] == SLIDING else None
        return replace(self.mask_spec, sliding_window=window)

    def update_from_config(
        self,
        model: ModelConfig,
        *,
        max_seq_len: int,
        tokenizer: BaseTokenizer | None = None,
        moe_force_load_balance: bool = False,
    ) -> None:
        require(
            model.sliding_window is None,
            "model.sliding_window: gpt-oss's sliding layers take their window from the flavor "
            "(config.json sliding_window); leave model.sliding_window unset",
        )
        super().update_from_config(
            model,
            max_seq_len=max_seq_len,
            tokenizer=tokenizer,
            moe_force_load_balance=moe_force_load_balance,
        )

    def check_parallelism(self, parallel_dims: ParallelDims) -> None:
        check_tp_divides_heads(parallel_dims.tp, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads)
        check_expert_layout(parallel_dims, self.moe, {"moe_hidden_dim": self.moe_hidden_dim})

    def geometry(self) -> Geometry:
        """A MoE in every block; its biases and attention sinks (below 0.1 % of the
        weights) are not counted."""
        return Geometry(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            ffn_dim=self.moe_hidden_dim,
            vocab_size=self.vocab_size,
            experts=Experts.from_moe(self.moe, self.moe_hidden_dim),
        )

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameter count and training FLOPs per token (``common/args.py``); attention adds
        ``12 * n_heads * head_dim`` times the keys each query sees per layer (the window on
        sliding layers)."""
        seen = sum(
            min(seq_len, self.attention_window) if kind == SLIDING else seq_len
            for kind in self.layer_types
        )
        attention = 12 * self.n_heads * self.head_dim * seen
        return nparams_and_flops(model, attention, self.moe, False)
