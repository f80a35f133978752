"""What a feed-forward keeps for backward (a dense SwiGLU, or a MoE layer with routed and
shared experts under expert parallel) and its widest hidden activation."""

from __future__ import annotations

from torchtitan.estimate.closed_form.inputs import Layout, LoRA
from torchtitan.protocols.geometry import Geometry


def ffn_kept_per_token(g: Geometry, lay: Layout, a: int, moe: bool, lora: LoRA | None) -> float:
    """A dense SwiGLU keeps w1, w3, silu and their product (saved by w2: not by a frozen
    w2 without an adapter). A MoE layer keeps the router's fp32 input copy, scores and
    routing weights, three int64 index vectors (gather, dispatch, combine) and, per routed
    token (top_k per token; balanced routing), the dispatched input, the SwiGLU's four hidden
    tensors and the fp32 expert output that its routing weight scales; plus the shared
    experts' SwiGLU (and, gated, their output and the gate)."""
    if not moe:
        product = lora is None or lora.keeps_input(("w2",))
        return (3 + product) * a * g.ffn_dim / lay.tp
    e = g.experts
    router = 4 * (g.dim + e.num_experts + e.top_k) + 3 * 8 * e.top_k
    routed = e.top_k * (a * (g.dim + 4 * e.hidden_dim / lay.etp) + 4 * g.dim)
    # a gated shared expert: its output and the gate's sigmoid, both kept by their product
    gate = a * (g.dim + 1) if e.shared_gate else 0
    return router + routed + 4 * a * e.shared_hidden_dim / lay.tp + gate


def ffn_width(g: Geometry, lay: Layout) -> float:
    """Per token, the widest feed-forward hidden activation (its backward temporaries)."""
    dense = g.ffn_dim / lay.tp
    if g.experts is None:
        return dense
    e = g.experts
    return max(dense, e.top_k * e.hidden_dim / lay.etp + e.shared_hidden_dim / lay.tp)
