"""Arguments of the Qwen3.5 text models (dense and MoE): hybrid stacks in which Gated
DeltaNet layers (linear attention, ``layers/gated_deltanet.py``) precede gated full-attention
layers (three to one in the published models), zero-centred RMSNorms, partial RoPE on a
quarter of each head's channels, and a dense SwiGLU or a MoE (routed experts plus a gated
shared expert) in every block."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from torch import nn

from torchtitan.layers.moe import MoEArgs
from torchtitan.models.common.args import (
    check_expert_layout,
    check_no_experts,
    check_tp_divides_heads,
    nparams_and_flops,
    require,
)
from torchtitan.protocols.geometry import DeltaRuleMixer, Experts, Geometry
from torchtitan.protocols.model import BaseModelArgs

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims

# layer_types as config.json names them: Gated DeltaNet (the delta rule) or full attention
DELTA_RULE, FULL = "linear_attention", "full_attention"


def qwen3_5_moe(num_experts: int, top_k: int) -> MoEArgs:
    """Qwen3.5-MoE routing: softmax over all experts, top-k renormalised, one shared expert
    scaled by its sigmoid gate, no expert-bias balancing (as published)."""
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=1,
        top_k=top_k,
        score_func="softmax",
        route_norm=True,
        load_balance_coeff=None,
        shared_expert_gate=True,
    )


@dataclass
class Qwen3_5ModelArgs(BaseModelArgs):
    vocab_size: int = 248320
    dim: int = 4096
    n_layers: int = 32
    # each layer's mixer (config.json layer_types); empty: full attention every
    # full_attention_interval-th layer, Gated DeltaNet elsewhere
    layer_types: list[str] = field(default_factory=list)
    full_attention_interval: int = 4
    # gated full attention
    n_heads: int = 16
    n_kv_heads: int = 4
    head_dim: int = 256
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25  # RoPE on the first quarter of each head's channels
    # Gated DeltaNet
    delta_rule_n_k_heads: int = 16
    delta_rule_n_v_heads: int = 32
    delta_rule_k_head_dim: int = 128
    delta_rule_v_head_dim: int = 128
    delta_rule_conv_kernel: int = 4
    # tokens per chunk of the chunked delta rule (a [chunk, chunk] system per chunk and head)
    delta_rule_chunk_size: int = 64
    ffn_hidden_dim: int = 12288  # dense SwiGLU hidden size (intermediate_size)
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    moe: MoEArgs | None = None
    moe_hidden_dim: int = 512  # one routed expert's hidden size (moe_intermediate_size)
    shared_expert_hidden_dim: int = 512  # shared_expert_intermediate_size
    depth_init: bool = True

    def __post_init__(self) -> None:
        if not self.layer_types:
            interval = self.full_attention_interval
            self.layer_types = [
                FULL if (i + 1) % interval == 0 else DELTA_RULE for i in range(self.n_layers)
            ]

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def n_full_layers(self) -> int:
        return sum(kind == FULL for kind in self.layer_types)

    def check_parallelism(self, parallel_dims: ParallelDims) -> None:
        check_tp_divides_heads(
            parallel_dims.tp,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            delta_rule_n_k_heads=self.delta_rule_n_k_heads,
            delta_rule_n_v_heads=self.delta_rule_n_v_heads,
        )
        if self.moe is None:
            check_no_experts(parallel_dims, "this qwen3_5 flavor (dense)")
        else:
            check_expert_layout(
                parallel_dims,
                self.moe,
                {
                    "moe_hidden_dim": self.moe_hidden_dim,
                    "shared_expert_hidden_dim": self.shared_expert_hidden_dim,
                },
            )
        require(
            not (self.tie_word_embeddings and parallel_dims.pp > 1),
            "parallelism.pipeline_parallel_degree: this qwen3_5 flavor ties the output layer "
            "to the embedding, which sit on different pipeline stages; use "
            "pipeline_parallel_degree 1 or an untied flavor",
        )

    def geometry(self) -> Geometry | None:
        """Gated DeltaNet blocks by ``layer_types``, gated GQA with q/k norms in the others
        (partial RoPE costs nothing extra), zero-centred norms, a dense SwiGLU or a MoE with
        one gated shared expert of ``shared_expert_hidden_dim`` in every block. None for
        other mixers in ``layer_types``."""
        kinds = list(self.layer_types)
        if len(kinds) != self.n_layers or set(kinds) - {DELTA_RULE, FULL}:
            return None
        delta_rule_layers = tuple(i for i, kind in enumerate(kinds) if kind == DELTA_RULE)
        return Geometry(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            # no dense block in a MoE flavor: its unused ffn_hidden_dim would count as the
            # widest feed-forward
            ffn_dim=self.ffn_hidden_dim if self.moe is None else self.moe_hidden_dim,
            vocab_size=self.vocab_size,
            qk_norm=True,
            tied_embeddings=self.tie_word_embeddings,
            experts=self._experts(),
            delta_rule=DeltaRuleMixer(
                delta_rule_layers,
                self.delta_rule_n_k_heads,
                self.delta_rule_n_v_heads,
                self.delta_rule_k_head_dim,
                self.delta_rule_v_head_dim,
                self.delta_rule_conv_kernel,
                self.delta_rule_chunk_size,
            )
            if delta_rule_layers
            else None,
            output_gate=True,
            zero_centred_norms=True,
        )

    def _experts(self) -> Experts | None:
        """The routed experts and the one shared expert of its own width, gated."""
        if self.moe is None:
            return None
        shared = self.moe.num_shared_experts > 0
        return replace(
            Experts.from_moe(self.moe, self.moe_hidden_dim),
            shared_hidden_dim=self.shared_expert_hidden_dim if shared else 0,
            shared_gate=self.moe.shared_expert_gate and shared,
        )

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameter count and training FLOPs per token (``common/args.py``). Full-attention
        layers add ``12 * n_heads * head_dim * seq_len``; a Gated DeltaNet layer adds the
        chunked rule's per-token work, ``6 * 2 * chunk * (k_dim + v_dim)`` for the intra-chunk
        products and ``6 * 2 * 2 * k_dim * v_dim`` for reading and updating the state, per
        value head (independent of the sequence length)."""
        full = 12 * self.n_full_layers * self.n_heads * self.head_dim * seq_len
        k, v = self.delta_rule_k_head_dim, self.delta_rule_v_head_dim
        per_head = 12 * self.delta_rule_chunk_size * (k + v) + 24 * k * v
        delta_rule = (self.n_layers - self.n_full_layers) * self.delta_rule_n_v_heads * per_head
        return nparams_and_flops(model, full + delta_rule, self.moe, self.tie_word_embeddings)
