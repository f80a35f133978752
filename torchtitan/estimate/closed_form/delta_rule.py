"""What a Gated DeltaNet mixer keeps for backward and what its backward adds, for the
pure-PyTorch chunked delta rule (``layers/gated_deltanet.py``)."""

from __future__ import annotations

import math

from torchtitan.estimate.closed_form.inputs import Layout, Run
from torchtitan.protocols.geometry import Geometry


def delta_rule_kept_per_token(g: Geometry, lay: Layout, run: Run, a: int) -> float:
    """Per local token, what one Gated DeltaNet mixer keeps for backward (its input, the
    attention norm's output, is counted with the norms), from what autograd saves in
    ``GatedDeltaNet.forward`` and the pure-PyTorch ``chunk_gated_delta_rule`` (heads split
    over tp; checked against ``saved_tensors_hooks`` on one layer). ``e``: the bytes of its
    element-wise values, the compute dtype under FSDP, fp32 otherwise (fp32 parameters, or
    autocast, which leaves products with fp32 weights in fp32).

    * convolution: its input (the q/k/v projections concatenated), one padded shifted copy
      per further tap (K - 1 of them, each the sequence plus the shift), its output (SiLU's
      input);
    * q/k L2 norms: fp32 copies of q and k (of the whole SiLU output when that is fp32) and
      an rsqrt per key head;
    * gates and output: fp32 z and silu(z), the head norm's fp32 input and rsqrt, the gate's
      fp32 normalised values, the normalised values, out_proj's input; softplus's input and
      output, beta (sigmoid output): 4 fp32 scalars per value head;
    * the chunked rule, fp32, over the sequence padded to whole chunks (per value head;
      queries/keys repeated to the value heads): q, k, k * beta, w and the batched matmuls'
      contiguous copies of q, k * beta and k^T (twice; none when the sequence is padded,
      which makes them contiguous): 8 x k_dim; the loop's q * reads and
      k * tail of every chunk but the last state's: 2 x k_dim; v, u and the corrected values
      v_new: 3 x v_dim; per chunk five [C, C] matrices (decay, K K^T, the unit-triangular
      system, Q K^T, the decayed intra-chunk attention): 5 x C per token; beta, reads, the
      two exponentials of the cumulative decay and the tail: 5 scalars; the state entering
      each chunk ([k_dim, v_dim]) and its carry: per token (k_dim v_dim + 2) / C; plus the
      causal mask of each chunk ([C, C] bool, shared by the heads) and two per-token masks.
    """
    d, t = g.delta_rule, lay.tp
    e = a if lay.fsdp else 4
    k, v = d.key_dim / t, d.value_dim / t
    k_heads, heads = d.n_k_heads / t, d.n_v_heads / t
    k_rep, c, taps = heads * d.k_head_dim, d.chunk_size, d.conv_kernel
    seq = run.seq_len / lay.cp
    chunks = math.ceil(seq / c)
    mixed = 2 * k + v
    conv = a * mixed * (taps + taps * (taps - 1) / (2 * seq)) + e * mixed
    l2 = (8 * k if e < 4 else 4 * mixed) + 8 * k_heads
    gates = 16 * v + e * v + a * v + 16 * heads
    copies = 0 if seq % c else 4  # the batched matmuls' copies of non-contiguous operands
    rule = (
        4 * k_rep * (4 + copies + 2 * (1 - 1 / chunks))
        + 12 * v
        + heads * (20 * c + 20 + 4 * (d.k_head_dim * d.v_head_dim + 2) / c)
        + c
        + 5
    )
    return conv + l2 + gates + rule * chunks * c / seq


def delta_rule_backward_bytes(g: Geometry, lay: Layout, tokens: float) -> float:
    """A Gated DeltaNet block's backward temporaries (the pure-PyTorch rule; 0 without such
    blocks): about three fp32 gradients of its widest per-token tensor, over the value heads
    [k_dim], [v_dim] or [C] (within about 20 % of tracked backwards of one layer)."""
    if g.delta_rule is None:
        return 0.0
    d = g.delta_rule
    widest = max(d.k_head_dim, d.v_head_dim, d.chunk_size)
    return 3 * 4 * tokens * d.n_v_heads / lay.tp * widest
