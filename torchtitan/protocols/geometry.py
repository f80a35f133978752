"""What a decoder's blocks hold, as the memory estimator's closed form counts them: the token
mixer (grouped-query attention, optionally with per-head q/k norms and an output gate; latent
attention; the Gated DeltaNet mixer in some blocks), the feed-forward (a dense SwiGLU or a MoE
layer) and the model's width, depth and vocabulary. Each model's args describe themselves
(``BaseModelArgs.geometry``), so the estimator never asks which model it has."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.layers.moe import MoEArgs


@dataclass(frozen=True)
class Experts:
    """The MoE feed-forward of every block after the first ``dense_layers``."""

    num_experts: int
    top_k: int
    hidden_dim: int  # one routed expert's
    shared_hidden_dim: int  # all shared experts together (0: none)
    dense_layers: int
    shared_gate: bool = False  # the shared experts' output scaled by sigmoid(x . w)

    @classmethod
    def from_moe(cls, moe: MoEArgs, hidden_dim: int, dense_layers: int = 0) -> Experts:
        """Routed experts of ``hidden_dim`` each and ``moe.num_shared_experts`` shared ones
        of the same size."""
        return cls(
            moe.num_experts,
            moe.top_k,
            hidden_dim,
            moe.num_shared_experts * hidden_dim,
            dense_layers,
        )


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (MLA): queries and keys/values through low-rank latents."""

    q_latent_rank: int  # 0: one full-rank query projection
    kv_latent_rank: int
    rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class DeltaRuleMixer:
    """The Gated DeltaNet mixer (``layers/gated_deltanet.py``) of the blocks ``layer_ids``
    (the others: full attention). Query/key heads serve ``n_v_heads / n_k_heads`` value heads
    each; the chunked delta rule works on chunks of ``chunk_size`` tokens."""

    layer_ids: tuple[int, ...]
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    chunk_size: int

    @property
    def layers(self) -> int:
        return len(self.layer_ids)

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim


@dataclass(frozen=True)
class Geometry:
    """A decoder of ``n_layers`` blocks, each a token mixer and a feed-forward between
    RMSNorms, with an embedding, a final norm and an output layer (biases, attention sinks and
    other parameters below 0.1 % of the weights are not counted)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # of queries and keys
    ffn_dim: int  # of the dense feed-forward
    vocab_size: int
    qk_norm: bool = False  # per-head RMSNorm of queries and keys
    tied_embeddings: bool = False
    experts: Experts | None = None
    mla: LatentAttention | None = None
    delta_rule: DeltaRuleMixer | None = None  # Gated DeltaNet blocks (the rest: attention)
    output_gate: bool = False  # wq also yields a sigmoid gate per attention output channel
    zero_centred_norms: bool = False  # every RMSNorm is layers/norms.ZeroCenteredRMSNorm

    @property
    def v_dim(self) -> int:
        """All heads' value channels (the attention output width)."""
        return self.n_heads * (self.mla.v_head_dim if self.mla else self.head_dim)

    @property
    def moe_layers(self) -> int:
        return 0 if self.experts is None else self.n_layers - self.experts.dense_layers

    @property
    def delta_rule_layers(self) -> int:
        return 0 if self.delta_rule is None else self.delta_rule.layers

    def block_kinds(self) -> list[tuple[float, bool, bool]]:
        """(share of the blocks, Gated DeltaNet mixer, MoE feed-forward) of each kind of
        block the model has. The mixer and the feed-forward are counted apart (their sizes
        add), so the shares are products of the two: exact for every model here, in which
        one of the two is the same in every block."""
        delta_rule = self.delta_rule_layers / self.n_layers
        moe = self.moe_layers / self.n_layers
        return [
            (mixer_share * ffn_share, is_delta_rule, is_moe)
            for is_delta_rule, mixer_share in ((False, 1 - delta_rule), (True, delta_rule))
            for is_moe, ffn_share in ((False, 1 - moe), (True, moe))
            if mixer_share * ffn_share > 0
        ]
