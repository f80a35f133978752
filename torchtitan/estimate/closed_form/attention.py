"""What an attention mixer keeps for backward (grouped-query attention with its optional
per-head q/k norms and output gate, latent attention), under context parallel too."""

from __future__ import annotations

from torchtitan.estimate.closed_form.inputs import Layout, Run
from torchtitan.estimate.closed_form.norms import model_norm_kept_bytes, norm_kept_bytes
from torchtitan.protocols.geometry import Geometry


def attention_kept_per_token(g: Geometry, lay: Layout, run: Run, a: int) -> float:
    """What attention keeps for backward per local token (q_local = this rank's heads x
    head_dim): q, k, v and the output, plus under context parallel (torchtitan's CP
    attention) the gathered keys/values and chunk outputs (allgather) or the fp32 output
    of the ring (alltoall) or of the head all-to-all (ulysses)."""
    q_local = g.n_heads * g.head_dim / lay.tp
    if lay.cp == 1:
        return a * 4 * q_local
    if run.cp_rotate == "allgather":
        return a * (3 + 2 * lay.cp) * q_local
    if run.cp_rotate == "alltoall":
        return (3 * a + 4) * q_local
    return 5 * a * q_local


def projection_kept_per_token(g: Geometry, lay: Layout, target: str, a: int) -> float:
    """Per token, what attention keeps besides q, k, v and its output: per-head q/k norms
    keep their inputs; latent attention's low-rank norms keep theirs and their outputs (saved
    by the up-projections; replicated under TP), and its output, computed with values padded
    to the query head size, is sliced to the value heads into a copy that wo keeps. An
    output gate keeps its sigmoid and the gated output (what wo keeps)."""
    if g.mla is not None:
        kept = (
            norm_kept_bytes(a, g.mla.kv_latent_rank, target)
            + a * g.mla.kv_latent_rank
            + a * g.v_dim / lay.tp
        )
        if g.mla.q_latent_rank:
            kept += norm_kept_bytes(a, g.mla.q_latent_rank, target) + a * g.mla.q_latent_rank
        return kept
    gate = 2 * a * g.n_heads * g.head_dim / lay.tp if g.output_gate else 0.0
    if g.qk_norm:
        heads = (g.n_heads + g.n_kv_heads) / lay.tp
        return gate + heads * model_norm_kept_bytes(g, a, g.head_dim, target)
    return gate


def recomputed_attention_keeps(g: Geometry, lay: Layout, run: Run, tokens: float) -> float:
    """What a block that activation checkpointing recomputes still keeps of its attention:
    the output and its fp32 log-sum-exp (not rebuilt), when the AC policy keeps them."""
    if not run.ac_keeps_attention:
        return 0.0
    return tokens * (run.param_bytes * g.n_heads * g.head_dim + 4 * g.n_heads) / lay.tp


def _cp_chunks(lay: Layout, run: Run) -> tuple[int, list[int]]:
    """(chunk length, the global indices of rank 0's chunks) of one sequence under CP."""
    if run.cp_headtail:
        return run.seq_len // (2 * lay.cp), [0, 2 * lay.cp - 1]
    return run.seq_len // lay.cp, [0]


def attention_mask_bytes(lay: Layout, run: Run, a: int) -> float:
    """allgather CP: one causal mask [chunk, keys up to the chunk's end] per local chunk,
    shared by the batch and heads (bool on CPU; CUDA's memory-efficient kernel keeps it as
    an additive mask in the compute dtype)."""
    if lay.cp == 1 or run.cp_rotate != "allgather":
        return 0.0
    size, chunks = _cp_chunks(lay, run)
    per_element = a if run.target == "cuda" else 1
    return per_element * sum(size * (c + 1) * size for c in chunks)


def ring_backward_bytes(g: Geometry, lay: Layout, run: Run, batch: int, tokens: float) -> float:
    """alltoall (ring) CP backward temporaries. CUDA (fp32 block math): two fp32 [batch,
    heads, chunk, chunk] blocks (probabilities and their gradient) and fp32 working copies
    of q, dq, the held key/value block and its accumulated and in-flight gradients, about
    6 x q_local per token (within 2 % of traces of the debug models). CPU (fused flash
    kernels): the fp32 dq, the held and the arriving K/V blocks, the held block's fp32 dK/dV
    with the one in flight and the one arriving, the kernel's dq and its dK/dV over a key
    span."""
    if lay.cp == 1 or run.cp_rotate != "alltoall":
        return 0.0
    size, _ = _cp_chunks(lay, run)
    q_local = g.n_heads * g.head_dim / lay.tp
    if run.target == "cpu":
        a = run.param_bytes
        return (36 + 3 * a) * q_local * tokens
    return 2 * 4 * batch * g.n_heads / lay.tp * size * size + 6 * 4 * q_local * tokens
