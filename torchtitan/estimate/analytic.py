"""Closed-form per-rank peak memory of a decoder (Llama, Qwen3 with q/k norms and tied
embeddings, DeepSeek-V3's latent attention, MoE blocks under expert parallel, Qwen3.5's
hybrid of Gated DeltaNet and gated attention blocks), for instant sweeps (the planner, mode
analytic) and as a cross-check of the traced figure.

Assumptions: AdamW (two fp32 states), fp32 master parameters, two training iterations (the
peak is a steady-state step), the model repeats KV heads before attention, and the kernels of
the target device: on CUDA the fused rms_norm saves its input and an fp32 rstd; on CPU the
rms_norm decomposition saves fp32 copies. Accurate to well under 1 % of the trace when the peak
is in the loss backward (the usual case for large vocabularies); approximate when it moves into
the layers' backward or the optimizer step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from torchtitan.components.adapters.lora import LORA, matches_target
from torchtitan.components.adapters.qlora import (
    NF4_BYTES_PER_VALUE,
    QUANTIZE_BYTES_PER_VALUE,
    QUANTIZE_SCRATCH_BYTES,
    uses_nf4,
)
from torchtitan.components.optimizers.muon import resolve_ns_dtype
from torchtitan.components.quantization import FLOAT8_LINEAR
from torchtitan.config import ConfigError
from torchtitan.distributed.activation_checkpoint import keeps_attention_output
from torchtitan.layers.loss import auto_chunk_tokens
from torchtitan.protocols.geometry import DeltaRuleMixer, Geometry, LatentAttention

GiB = 2**30


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ac: str = "none"  # "none" | "full" | "selective:N" | "selective:op"
    ep: int = 1  # expert parallel (borrows ranks of dp_shard x cp)
    etp: int = 1  # expert tensor parallel (1 or tp)

    @property
    def fsdp(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def describe(self) -> str:
        parts = [
            f"{n}={v}"
            for n, v in (
                ("dp_replicate", self.dp_replicate),
                ("dp_shard", self.dp_shard),
                ("cp", self.cp),
                ("tp", self.tp),
                ("pp", self.pp),
                ("ep", self.ep),
            )
            if v > 1
        ]
        return " ".join(parts or ["single device"]) + f", AC {self.ac}"


@dataclass(frozen=True)
class Run:
    seq_len: int
    local_batch: int
    grad_accum: int = 1
    param_bytes: int = 2  # FSDP compute dtype (or autocast dtype without FSDP)
    foreach_optimizer: bool = False
    loss_parallel: bool = True
    target: str = "cuda"
    pp_microbatch: int = 1
    pp_all_in_flight: bool = (
        False  # GPipe, LoopedBFS: every micro-batch's forward before any backward
    )
    cp_rotate: str = "allgather"  # ParallelDims.cp_rotate_method
    cp_headtail: bool = True  # ParallelDims.cp_load_balancer == "headtail"
    ac_keeps_attention: bool = False  # distributed.activation_checkpoint.keeps_attention_output
    lora: LoRA | None = None  # adapters on a frozen base (converter lora)
    loss_chunk: int = 0  # training.loss_chunk_size as it applies (0: full logits; -1: auto)
    muon_ns_bytes: int = 0  # Muon: bytes per value of its Newton-Schulz iteration (0: AdamW)
    float8: bool = False  # float8 linears (converter float8): not modelled, traced only


@dataclass(frozen=True)
class LoRA:
    """Rank-``rank`` adapters on the linears named in ``adapted`` (leaf names, the same in
    every block, and "output") of a frozen base: only adapters get gradients and optimizer
    states, a frozen linear keeps no input for backward, an adapter keeps its [tokens, rank]
    middle (dropout 0). Dense decoders only (no MoE, no latent attention). ``nf4``: the
    adapted linears' base weights are stored as NF4 (QLoRA)."""

    rank: int
    adapted: frozenset[str]
    nf4: bool = False

    def keeps_input(self, names: tuple[str, ...]) -> bool:
        return bool(self.adapted.intersection(names))


@dataclass
class AnalyticEstimate:
    peak_bytes: int
    phase: str
    phases: dict[str, int]
    items: dict[str, int]


Shape = tuple[int, int, str]
BASE_LOAD = "base load (made NF4 block by block)"  # QLoRA's start: no trace covers it


def training_peak(estimate: AnalyticEstimate) -> tuple[int, str]:
    """(bytes, phase) of the largest phase of the training step itself."""
    phase = max((p for p in estimate.phases if p != BASE_LOAD), key=estimate.phases.get)
    return estimate.phases[phase], phase


def _attention_shapes(g: Geometry) -> list[Shape]:
    """(rows, cols, tp style) of one block's attention weights; colwise shards rows,
    rowwise cols, rep is replicated."""
    if g.mla is not None:
        return _latent_attention_shapes(g, g.mla)
    linears = _dense_linears(g)
    shapes = [linears[name] for name in ("wq", "wk", "wv", "wo")]
    if g.qk_norm:
        shapes += [(g.head_dim, 1, "rep"), (g.head_dim, 1, "rep")]
    return shapes


def _dense_linears(g: Geometry) -> dict[str, Shape]:
    """The linears of a block with grouped-query attention and a dense SwiGLU, by leaf name
    (with an output gate, wq yields each head's query and as many gate logits)."""
    q, kv = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    return {
        "wq": ((2 if g.output_gate else 1) * q, g.dim, "col"),
        "wk": (kv, g.dim, "col"),
        "wv": (kv, g.dim, "col"),
        "wo": (g.dim, q, "row"),
        "w1": (g.ffn_dim, g.dim, "col"),
        "w3": (g.ffn_dim, g.dim, "col"),
        "w2": (g.dim, g.ffn_dim, "row"),
    }


def _adapter_shapes(shape: Shape, rank: int) -> list[Shape]:
    """lora_a [rank, in] and lora_b [out, rank] as tensor parallel places them: for a
    rowwise base A is sharded like its input and B replicated, otherwise A is replicated and
    B sharded like its output."""
    rows, cols, style = shape
    if style == "row":
        return [(rank, cols, "row"), (rows, rank, "rep")]
    return [(rank, cols, "rep"), (rows, rank, style)]


def _block_adapter_shapes(g: Geometry, lora: LoRA | None) -> list[Shape]:
    if lora is None:
        return []
    linears = _dense_linears(g)
    return [
        s
        for n in sorted(lora.adapted & linears.keys())
        for s in _adapter_shapes(linears[n], lora.rank)
    ]


def _root_adapter_shapes(g: Geometry, lora: LoRA | None, last: bool) -> list[Shape]:
    if lora is None or not last or "output" not in lora.adapted:
        return []
    return _adapter_shapes((g.vocab_size, g.dim, "col"), lora.rank)


@dataclass(frozen=True)
class _NF4Bases:
    """QLoRA's NF4 base weights on a stage (all 0 without): TP-local numel per block and of
    the root, the stage's FSDP-sharded numel, the largest one (dequantized one at a time)
    and the largest group made at once at the start (a block, or the root's)."""

    layer_local: float = 0
    root_local: float = 0
    stage_sharded: float = 0
    largest: float = 0
    group_sharded: float = 0


def _nf4_bases(g: Geometry, lay: Layout, run: Run, layers: int, last: bool) -> _NF4Bases:
    """The base weights of the adapted linears, stored as NF4 under QLoRA."""
    if run.lora is None or not run.lora.nf4:
        return _NF4Bases()
    linears = _dense_linears(g)
    block = [linears[n] for n in sorted(run.lora.adapted & linears.keys())]
    root = [(g.vocab_size, g.dim, "col")] if last and "output" in run.lora.adapted else []
    (layer_local, layer_sharded), (root_local, root_sharded) = (
        _local_numel(block, lay),
        _local_numel(root, lay),
    )
    largest = max((_local_numel([s], lay)[0] for s in block + root), default=0)
    return _NF4Bases(
        layer_local,
        root_local,
        layers * layer_sharded + root_sharded,
        largest,
        max(layer_sharded, root_sharded),
    )


def _ac_kept(
    g: Geometry,
    lay: Layout,
    run: Run,
    tokens: float,
    a_in: float,
    mixers: list[tuple[float, bool, float]],
) -> tuple[float, float]:
    """(what one block keeps under the configured AC, the mean over the blocks; what the
    recompute of the largest block rebuilds). ``mixers``: (share of the blocks, Gated
    DeltaNet, what such a block keeps without AC) per kind of token mixer."""
    # the attention output and its fp32 log-sum-exp, kept by a recomputed attention block
    # (not rebuilt; only attention kernels are kept, none in Gated DeltaNet blocks)
    attention_out = (
        tokens * (run.param_bytes * g.n_heads * g.head_dim + 4 * g.n_heads) / lay.tp
        if run.ac_keeps_attention
        else 0
    )
    kept_out = {False: attention_out, True: 0.0}
    a_layer = sum(share * a_kind for share, _, a_kind in mixers)
    attention_kept = sum(share * kept_out[linear] for share, linear, _ in mixers)
    recompute = max(a_kind - kept_out[linear] for _, linear, a_kind in mixers)
    if lay.ac == "full":
        return a_in + attention_kept, recompute
    if lay.ac.startswith("selective:"):
        every = int(lay.ac.split(":")[1])
        return (a_layer * (every - 1) + a_in + attention_kept) / every, recompute
    return a_layer, 0.0


def _latent_attention_shapes(g: Geometry, mla: LatentAttention) -> list[Shape]:
    q = g.n_heads * g.head_dim
    if mla.q_latent_rank:
        queries = [
            (mla.q_latent_rank, g.dim, "rep"),
            (mla.q_latent_rank, 1, "rep"),
            (q, mla.q_latent_rank, "col"),
        ]
    else:
        queries = [(q, g.dim, "col")]
    nope = g.head_dim - mla.rope_head_dim
    return queries + [
        (mla.kv_latent_rank + mla.rope_head_dim, g.dim, "rep"),
        (mla.kv_latent_rank, 1, "rep"),
        (g.n_heads * (nope + mla.v_head_dim), mla.kv_latent_rank, "col"),
        (g.dim, g.v_dim, "row"),
    ]


def _linear_attention_shapes(d: DeltaRuleMixer, dim: int) -> list[Shape]:
    """A Gated DeltaNet mixer: the q/k/v/z/a/b projections, the convolution taps, decay rates
    and dt_bias split by heads under TP (with the projections' rows), the per-head gated norm
    replicated, out_proj row-wise."""
    k, v, heads = d.key_dim, d.value_dim, d.n_v_heads
    return [
        (k, dim, "col"),  # q_proj
        (k, dim, "col"),  # k_proj
        (v, dim, "col"),  # v_proj
        (v, dim, "col"),  # z_proj
        (heads, dim, "col"),  # a_proj
        (heads, dim, "col"),  # b_proj
        (k, d.conv_kernel, "col"),  # q_conv
        (k, d.conv_kernel, "col"),  # k_conv
        (v, d.conv_kernel, "col"),  # v_conv
        (heads, 1, "col"),  # dt_bias
        (heads, 1, "col"),  # A_log
        (d.v_head_dim, 1, "rep"),  # norm.weight
        (dim, v, "row"),  # out_proj
    ]


def _ffn_shapes(g: Geometry, moe: bool) -> list[Shape]:
    """A dense SwiGLU, or a router, the routed experts (``exp``: split over expert parallel,
    their hidden size over expert tensor parallel), the shared experts and their gate."""
    if not moe:
        linears = _dense_linears(g)
        return [linears[name] for name in ("w1", "w3", "w2")]
    e = g.experts
    routed = e.num_experts * e.hidden_dim
    shapes = [(e.num_experts, g.dim, "rep")] + [(routed, g.dim, "exp")] * 3
    if e.shared_hidden_dim:
        s = e.shared_hidden_dim
        shapes += [(s, g.dim, "col"), (s, g.dim, "col"), (g.dim, s, "row")]
    if e.shared_gate:
        shapes.append((1, g.dim, "rep"))
    return shapes


def _block_shapes(g: Geometry, moe: bool, linear: bool = False) -> list[Shape]:
    mixer = _linear_attention_shapes(g.delta_rule, g.dim) if linear else _attention_shapes(g)
    return mixer + _ffn_shapes(g, moe) + [(g.dim, 1, "rep"), (g.dim, 1, "rep")]


def _root_shapes(g: Geometry, first: bool, last: bool) -> list[Shape]:
    """The embedding on the first stage; the final norm and (untied) output on the last."""
    shapes = [(g.vocab_size, g.dim, "col")] if first else []
    if last:
        shapes += [(g.dim, 1, "rep")] + (
            [] if g.tied_embeddings else [(g.vocab_size, g.dim, "col")]
        )
    return shapes


def _local_numel(shapes: list[Shape], lay: Layout) -> tuple[int, int]:
    """(TP/EP-local numel, then FSDP-sharded numel; FSDP pads dim 0 to the shard count;
    experts are sharded over the data-parallel ranks that expert parallel leaves)."""
    shards = lay.dp_shard * lay.cp if lay.fsdp else 1
    local = sharded = 0
    for rows, cols, style in shapes:
        rows_l = rows // {"col": lay.tp, "exp": lay.ep * lay.etp}.get(style, 1)
        cols_l = cols // lay.tp if style == "row" else cols
        local += rows_l * cols_l
        sharded += math.ceil(rows_l / (shards // lay.ep if style == "exp" else shards)) * cols_l
    return local, sharded


def _norm_kept_bytes(a: int, d: int, target: str) -> float:
    """Per token, what one rms_norm keeps besides its output: CUDA's fused kernel keeps the
    input and an fp32 rstd; the CPU decomposition keeps an fp32 input (the input itself in
    fp32, else an fp32 copy while the input is dropped), an fp32 normalised copy and rstd."""
    if target == "cuda":
        return a * d + 4
    return 4 * d + 4 * d + 4


def _model_norm_kept_bytes(g: Geometry, a: int, d: int, target: str) -> float:
    """:func:`_norm_kept_bytes` for the model's RMSNorms. A zero-centred one (``layers/
    norms.py``) normalises an fp32 copy of its input (the input itself when fp32) without a
    weight and scales by ``1 + weight`` after: on either target the fp32 input, an fp32 rstd
    and the fp32 normalised values (kept by the scale)."""
    if g.zero_centred_norms:
        return 4 * d + 4 + 4 * d
    return _norm_kept_bytes(a, d, target)


def _attention_kept_per_token(g: Geometry, lay: Layout, run: Run, a: int) -> float:
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


def _cp_chunks(lay: Layout, run: Run) -> tuple[int, list[int]]:
    """(chunk length, the global indices of rank 0's chunks) of one sequence under CP."""
    if run.cp_headtail:
        return run.seq_len // (2 * lay.cp), [0, 2 * lay.cp - 1]
    return run.seq_len // lay.cp, [0]


def _attention_mask_bytes(lay: Layout, run: Run, a: int) -> float:
    """allgather CP: one causal mask [chunk, keys up to the chunk's end] per local chunk,
    shared by the batch and heads (bool on CPU; CUDA's memory-efficient kernel keeps it as
    an additive mask in the compute dtype)."""
    if lay.cp == 1 or run.cp_rotate != "allgather":
        return 0.0
    size, chunks = _cp_chunks(lay, run)
    per_element = a if run.target == "cuda" else 1
    return per_element * sum(size * (c + 1) * size for c in chunks)


def _ring_backward_bytes(g: Geometry, lay: Layout, run: Run, batch: int, tokens: float) -> float:
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


def _projection_kept_per_token(g: Geometry, lay: Layout, target: str, a: int) -> float:
    """Per token, what attention keeps besides q, k, v and its output: Qwen3's per-head q/k
    norms keep their inputs; MLA's low-rank norms keep theirs and their outputs (saved by
    the up-projections; replicated under TP), and its output, computed with values padded
    to the query head size, is sliced to the value heads into a copy that wo keeps.
    Qwen3.5's output gate keeps its sigmoid and the gated output (what wo keeps)."""
    if g.mla is not None:
        kept = (
            _norm_kept_bytes(a, g.mla.kv_latent_rank, target)
            + a * g.mla.kv_latent_rank
            + a * g.v_dim / lay.tp
        )
        if g.mla.q_latent_rank:
            kept += _norm_kept_bytes(a, g.mla.q_latent_rank, target) + a * g.mla.q_latent_rank
        return kept
    gate = 2 * a * g.n_heads * g.head_dim / lay.tp if g.output_gate else 0.0
    if g.qk_norm:
        heads = (g.n_heads + g.n_kv_heads) / lay.tp
        return gate + heads * _model_norm_kept_bytes(g, a, g.head_dim, target)
    return gate


def _linear_attention_kept_per_token(g: Geometry, lay: Layout, run: Run, a: int) -> float:
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


def _ffn_kept_per_token(g: Geometry, lay: Layout, a: int, moe: bool, lora: LoRA | None) -> float:
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


def _linear_backward_bytes(g: Geometry, lay: Layout, tokens: float) -> float:
    """A Gated DeltaNet block's backward temporaries (the pure-PyTorch rule; 0 without such
    blocks): about three fp32 gradients of its widest per-token tensor, over the value heads
    [k_dim], [v_dim] or [C] (within about 20 % of tracked backwards of one layer)."""
    if g.delta_rule is None:
        return 0.0
    d = g.delta_rule
    widest = max(d.k_head_dim, d.v_head_dim, d.chunk_size)
    return 3 * 4 * tokens * d.n_v_heads / lay.tp * widest


def _ffn_width(g: Geometry, lay: Layout) -> float:
    """Per token, the widest feed-forward hidden activation (its backward temporaries)."""
    dense = g.ffn_dim / lay.tp
    if g.experts is None:
        return dense
    e = g.experts
    return max(dense, e.top_k * e.hidden_dim / lay.etp + e.shared_hidden_dim / lay.tp)


def _mixer_activation_bytes(
    g: Geometry, lay: Layout, run: Run, a: int, tokens: float
) -> list[tuple[float, bool, float]]:
    """(share of the blocks, Gated DeltaNet, what one such block keeps without AC) for each
    kind of token mixer of the model (the feed-forward: the mean over dense and MoE)."""
    linear_share = g.delta_rule_layers / g.n_layers
    return [
        (share, linear, _layer_activation_bytes(g, lay, run, a, tokens, linear))
        for share, linear in ((1 - linear_share, False), (linear_share, True))
        if share > 0
    ]


def _hybrid_blocks(
    g: Geometry,
    lay: Layout,
    run: Run,
    tokens: float,
    a_in: float,
    mixers: list[tuple[float, bool, float]],
) -> list[tuple[float, float]] | None:
    """(what the block keeps under the configured AC, what its recompute rebuilds) of each
    block in order, for a model of Gated DeltaNet and attention blocks on one pipeline stage
    (None otherwise): which blocks every-N selective AC recomputes depends on their mixer."""
    if g.delta_rule is None or lay.pp > 1:
        return None
    a_kind = {linear: a for _, linear, a in mixers}
    # a recomputed attention block keeps its attention output and log-sum-exp
    kept_out = (
        tokens * (run.param_bytes * g.n_heads * g.head_dim + 4 * g.n_heads) / lay.tp
        if run.ac_keeps_attention
        else 0.0
    )
    every = int(lay.ac.split(":")[1]) if lay.ac.startswith("selective:") else 1
    blocks = []
    for i in range(g.n_layers):
        linear = i in g.delta_rule.layer_ids
        if lay.ac == "none" or (i + 1) % every:
            blocks.append((a_kind[linear], 0.0))
        else:
            out = 0.0 if linear else kept_out
            blocks.append((a_in + out, a_kind[linear] - out))
    return blocks


def _layer_activation_bytes(
    g: Geometry, lay: Layout, run: Run, a: int, tokens: float, linear: bool = False
) -> float:
    """What one block keeps without AC (the mean over the model's dense and MoE blocks),
    with an attention or (``linear``) a Gated DeltaNet mixer."""
    t = lay.tp
    sp = t  # sequence parallel shards the residual stream when TP is on
    moe_share = g.moe_layers / g.n_layers
    lora = run.lora
    ffn = (1 - moe_share) * _ffn_kept_per_token(g, lay, a, False, lora) + moe_share * (
        _ffn_kept_per_token(g, lay, a, True, lora) if g.experts else 0
    )
    if linear:
        mixer = _linear_attention_kept_per_token(g, lay, run, a)
    else:
        mixer = (
            _attention_kept_per_token(g, lay, run, a)
            + _projection_kept_per_token(g, lay, run.target, a)
            + 4 * g.n_heads / t  # logsumexp
        )
    # the norm outputs (all-gathered under SP), saved by the projections that take them
    norm_outputs = (
        2
        if lora is None
        else (lora.keeps_input(("wq", "wk", "wv")) + lora.keeps_input(("w1", "w3")))
    )
    adapters = 0 if lora is None else len(lora.adapted - {"output"})
    per_token = (
        2 * _model_norm_kept_bytes(g, a, g.dim, run.target) / sp  # attention_norm, ffn_norm
        + norm_outputs * a * g.dim
        + adapters * a * (lora.rank if lora else 0)  # each adapter's [tokens, rank] middle
        + mixer
        + ffn
    )
    return tokens * per_token + (0 if linear else _attention_mask_bytes(lay, run, a))


def not_covered(g: Geometry, lay: Layout, run: Run) -> str | None:
    """Why the closed form does not cover this model on this layout and run, or None."""
    if run.float8:
        return "float8 linears (their casts and scales; the trace covers them)"
    if lay.ac == "selective:op":
        return "op-level selective activation checkpointing"
    if g.delta_rule is not None and lay.cp > 1:
        # context_parallel.delta_rule keeps only the rule's inputs and received states and
        # recomputes each chunk in backward: not what this model counts
        return "context parallel over Gated DeltaNet layers"
    return None


def estimate(g: Geometry, lay: Layout, run: Run) -> AnalyticEstimate | None:
    """The per-rank peak of the most loaded pipeline stage (None where :func:`not_covered`
    says why: op-level selective AC, context parallel over Gated DeltaNet layers, float8)."""
    if not_covered(g, lay, run) is not None:
        return None
    stages = [_stage(g, lay, run, first=(s == 0), last=(s == lay.pp - 1)) for s in range(lay.pp)]
    return max(stages, key=lambda e: e.peak_bytes)


@dataclass
class _Stage:
    """Per-rank byte counts of one pipeline stage."""

    weights: float  # sharded fp32 parameters (full ones without FSDP)
    grads: float  # sharded fp32 gradients (of the trainable parameters)
    opt: float  # Adam states
    u_layer: float  # one block's gathered low-precision parameters
    u_root: float  # embedding/norm/output gathered (or autocast copies without FSDP)
    root_local: float  # TP-local numel of the root parameters on this stage
    layer_local: float  # TP-local numel of one block
    layer_sharded: float  # its FSDP shard
    trained_layer_local: float  # one block's trainable numel (all of it without LoRA)
    trained_layer_sharded: float
    trained_stage_local: float  # the stage's trainable numel, TP-local
    layers: int
    tokens: float  # per micro-batch on this rank
    a_in: float  # one block's input (all that full AC keeps)
    a_layer: float  # everything one block keeps without AC (mean over blocks)
    kept: float  # what one block keeps under the configured AC (mean over blocks)
    recompute: float  # what the largest recomputed block rebuilds in its backward (0 without AC)
    ring_backward: float  # CP ring attention's backward temporaries
    base_load: float  # QLoRA: the NF4 base, one fp32 block and one weight being quantized
    # (kept, rebuilt by its recompute) of each block in order, where blocks differ by mixer
    # (Gated DeltaNet and attention; one pipeline stage); None: every block is the mean
    blocks: list[tuple[float, float]] | None = None


def _block_activations(
    g: Geometry, lay: Layout, run: Run, tokens: float, frozen_copies: float
) -> tuple[float, float, float, float, list[tuple[float, float]] | None]:
    """A block's input bytes, its mean activation bytes, what AC keeps of a block and the
    largest recompute, and the per-block (kept, recompute) of hybrid stacks (or None)."""
    a = run.param_bytes
    # a block's input: the residual stream, fp32 without FSDP (autocast keeps fp32 weights)
    a_in = (a if lay.fsdp else 4) * tokens * g.dim / lay.tp
    mixers = [
        (share, linear, a_kind + frozen_copies)
        for share, linear, a_kind in _mixer_activation_bytes(g, lay, run, a, tokens)
    ]
    a_layer = sum(share * a_kind for share, _, a_kind in mixers)
    kept, recompute = _ac_kept(g, lay, run, tokens, a_in, mixers)
    blocks = _hybrid_blocks(g, lay, run, tokens, a_in, mixers)
    if blocks is not None:
        kept = sum(k for k, _ in blocks) / len(blocks)
        recompute = max(r for _, r in blocks)
    return a_in, a_layer, kept, recompute, blocks


def _stage_sizes(g: Geometry, lay: Layout, run: Run, first: bool, last: bool) -> _Stage:
    a = run.param_bytes
    layers = math.ceil(g.n_layers / lay.pp)
    batch = run.pp_microbatch if lay.pp > 1 else run.local_batch
    tokens = batch * run.seq_len / lay.cp
    layer_local, layer_sharded, largest_layer = _mean_block_numel(g, lay)
    root_local, root_sharded = _local_numel(_root_shapes(g, first, last), lay)
    params_sharded = layers * layer_sharded + root_sharded
    # (TP-local, FSDP-sharded) numel of what trains: everything, or under LoRA the adapters
    trained_layer, trained_root = (layer_local, layer_sharded), (root_local, root_sharded)
    if run.lora is not None:
        trained_layer = _local_numel(_block_adapter_shapes(g, run.lora), lay)
        trained_root = _local_numel(_root_adapter_shapes(g, run.lora, last), lay)
        layer_local, largest_layer = (
            layer_local + trained_layer[0],
            largest_layer + trained_layer[0],
        )
        root_local += trained_root[0]
        params_sharded += layers * trained_layer[1] + trained_root[1]
    trained_stage_local = layers * trained_layer[0] + trained_root[0]
    trained_sharded = layers * trained_layer[1] + trained_root[1]
    # QLoRA: NF4 bases, each dequantized to one low-precision weight inside its matmul
    nf4 = _nf4_bases(g, lay, run, layers, last)
    dequantized, nf4_saving = a * nf4.largest, a - NF4_BYTES_PER_VALUE
    frozen_copies = 0.0  # per block: low-precision copies of frozen weights kept for backward
    if lay.fsdp:
        u_layer = a * largest_layer - nf4_saving * nf4.layer_local + dequantized
        u_root = a * root_local - nf4_saving * nf4.root_local
    elif a == 4:
        u_layer, u_root = dequantized, 0
    elif run.lora is None:  # autocast caches low-precision copies of the weights for the step
        u_layer, u_root = 0, (layers * layer_local + root_local) * a
    else:  # it caches only trainable weights; a frozen linear's backward keeps its own copy
        # (an NF4 base keeps itself: it is dequantized again in backward)
        u_layer = dequantized
        output_copy = 0 if nf4.root_local else a * g.vocab_size * g.dim / lay.tp
        u_root = a * trained_stage_local + (output_copy if last else 0)
        frozen_copies = a * (layer_local - trained_layer[0] - nf4.layer_local)
    a_in, a_layer, kept, recompute, blocks = _block_activations(g, lay, run, tokens, frozen_copies)
    weights = 4 * params_sharded - (4 - NF4_BYTES_PER_VALUE) * nf4.stage_sharded
    optimizer_states = 8 * trained_sharded
    if run.muon_ns_bytes:  # one fp32 momentum buffer for the blocks' weight matrices
        optimizer_states -= 4 * layers * _muon_block_sharded(g, lay)
    return _Stage(
        weights,
        4 * trained_sharded,
        optimizer_states,
        u_layer,
        u_root,
        root_local,
        layer_local,
        layer_sharded,
        trained_layer[0],
        trained_layer[1],
        trained_stage_local,
        layers,
        tokens,
        a_in,
        a_layer,
        kept,
        recompute,
        _ring_backward_bytes(g, lay, run, batch, tokens),
        # QLoRA's start (components/qlora.PendingBase), bounded at its last block: the NF4
        # base, that block in fp32 (shards) and one gathered weight being quantized. (A Hugging
        # Face load's transient, the full value read and cast to fp32, is smaller: 6-8 bytes
        # per value of one weight against quantization's 9.6.)
        weights
        + 4 * nf4.group_sharded
        + QUANTIZE_BYTES_PER_VALUE * nf4.largest
        + QUANTIZE_SCRATCH_BYTES
        if nf4.largest
        else 0,
        blocks,
    )


def _muon_block_sharded(g: Geometry, lay: Layout) -> float:
    """FSDP-sharded numel of the mean block's weight matrices (what Muon trains)."""
    return sum(
        share * _local_numel([s for s in _block_shapes(g, moe, linear) if s[1] > 1], lay)[1]
        for share, linear, moe in g.block_kinds()
    )


def _muon_step_bytes(g: Geometry, lay: Layout, run: Run) -> float:
    """Muon's step (components/muon._exchange_and_iterate) holds five fp32 whole matrices of
    the largest size at its peak (the one iterated, the next received, the last result sent
    back, this rank's blocks of the next and the last round) and the iteration's copy, Gram
    matrix, its polynomial and next iterate; under FSDP x TP one more (the update and its
    result re-laid out over the second cut). Experts count as one stack."""
    largest = max(
        (rows * cols, min(rows, cols) ** 2)
        for _, linear, moe in g.block_kinds()
        for rows, cols, style in _block_shapes(g, moe, linear)
        if cols > 1
    )
    whole, gram = largest
    held = 6 if lay.fsdp and lay.tp > 1 else 5
    return 4 * held * whole + run.muon_ns_bytes * (2 * whole + 2 * gram)


def _mean_block_numel(g: Geometry, lay: Layout) -> tuple[float, float, int]:
    """(local numel, FSDP-sharded numel) of the mean block over the model's kinds of block
    (dense and MoE; attention and Gated DeltaNet), and the largest block's local numel (what
    one block gathers)."""
    kinds = [
        (share, _local_numel(_block_shapes(g, moe, linear), lay))
        for share, linear, moe in g.block_kinds()
    ]
    local = sum(share * numel[0] for share, numel in kinds)
    sharded = sum(share * numel[1] for share, numel in kinds)
    return local, sharded, max(numel[0] for _, numel in kinds)


def _stage(g: Geometry, lay: Layout, run: Run, first: bool, last: bool) -> AnalyticEstimate:
    st = _stage_sizes(g, lay, run, first, last)
    a = run.param_bytes
    grads = st.grads
    micro = max(1, run.local_batch // run.pp_microbatch)
    in_flight = 1
    if lay.pp > 1:  # 1F1B: pp - stage warm-up forwards
        in_flight = micro if run.pp_all_in_flight else (min(lay.pp, micro) if first else 1)
    activations = in_flight * st.layers * st.kept
    inputs = 16 * run.local_batch * run.seq_len / lay.cp
    # DDP's reducer: flat buckets as large as the gradients, held for the whole run
    ddp_buckets = grads if lay.dp_replicate > 1 and not lay.fsdp else 0.0
    base = st.weights + st.opt + st.u_root + inputs + ddp_buckets
    phases = {
        "optimizer step": st.weights
        + grads
        + st.opt
        + ddp_buckets
        + (grads if run.foreach_optimizer else 0)
        + (_muon_step_bytes(g, lay, run) if run.muon_ns_bytes else 0),
        # the output weight's gradient exists from the loss backward on (the embedding's
        # comes after the blocks)
        "layer backward": _layer_backward(st, g, lay, a, base)
        + (a * g.vocab_size * g.dim / lay.tp if last and run.lora is None else 0),
    }
    log_probs = 0.0
    if last:
        log_probs, phases["loss backward"] = _loss_backward(st, g, lay, run, first, base)
        phases["loss backward"] += activations
    if lay.pp > 1:
        phases["pipeline backward"] = _pipeline_backward(
            st, g, lay, run, base, activations, first, last
        )
    if st.base_load:
        phases[BASE_LOAD] = st.base_load
    phase = max(phases, key=phases.get)
    items = {
        "parameters (sharded fp32; NF4 bases)": st.weights,
        "gathered root parameters": st.u_root,
        "optimizer states": st.opt,
        "DDP gradient buckets": ddp_buckets,
        "activations kept for backward": activations,
        "saved log-probabilities": log_probs,
    }
    return AnalyticEstimate(
        int(phases[phase]),
        phase,
        {k: int(v) for k, v in phases.items()},
        {k: int(v) for k, v in items.items()},
    )


def _loss_backward(
    st: _Stage, g: Geometry, lay: Layout, run: Run, first: bool, base: float
) -> tuple[float, float]:
    """(saved log-probabilities, the loss backward's peak less the kept activations).
    Full logits: fp32 log-probabilities, their gradient and loss parallel's buffers. Chunked
    (``layers/loss.py``): the output weight's fp32 gradient and the hidden states' gradient,
    one chunk's fp32 logits (plus their low-precision copy), per-token log-sum-exp and
    indices."""
    a = run.param_bytes
    micro = max(1, run.local_batch // run.pp_microbatch)
    in_flight = micro if (lay.pp > 1 and run.pp_all_in_flight) else 1
    chunked = run.loss_chunk != 0
    vocab_local = g.vocab_size / lay.tp if (run.loss_parallel or chunked) else g.vocab_size
    # the final norm's output is kept by a trained output layer; an adapter keeps its middle
    output_kept = a * g.dim
    if run.lora is not None:
        output_kept = (a * (g.dim + run.lora.rank)) if "output" in run.lora.adapted else 0
    final_norm = st.tokens * (
        _model_norm_kept_bytes(g, a, g.dim, run.target) / lay.tp + output_kept
    )
    accum_grads = st.grads if run.grad_accum > 1 else 0
    if lay.pp > 1:  # later micro-batches: the stage's gradients and gathered parameters exist
        accum_grads = sum(_pipeline_held(st, lay, run, first, True))
    if chunked:
        chunk = (
            run.loss_chunk
            if run.loss_chunk > 0
            else auto_chunk_tokens(int(st.tokens), int(vocab_local), g.dim)
        )
        rows = min(chunk, st.tokens)
        logits = rows * vocab_local * (4 + (a if a < 4 else 0))
        weight_grad = 0.0 if run.lora is not None else vocab_local * g.dim
        transient = logits
        if a < 4:  # the weight gradient sums in fp32 and is cast back at the end; CUDA
            # multiplies each chunk in low precision, CPU casts the chunk to fp32 first
            if run.target == "cuda":
                transient = max(logits, a * (weight_grad + rows * vocab_local))
            else:
                transient = max(logits + 4 * rows * g.dim, a * weight_grad)
        grads = 4 * weight_grad + a * st.tokens * g.dim
        if lay.pp > 1:  # every in-flight micro-batch's stage output (hidden states)
            accum_grads += in_flight * a * st.tokens * g.dim
        return 0.0, base + accum_grads + final_norm + grads + transient + 14 * st.tokens
    loss_k = 3 if (lay.tp > 1 and run.loss_parallel) else 2  # fp32 gradient buffers
    log_probs = 4 * st.tokens * vocab_local
    if lay.pp > 1:  # every in-flight micro-batch keeps its logits (torch's stage) and
        # log-probabilities
        accum_grads += (
            in_flight * a * st.tokens * vocab_local + (in_flight - 1) * 4 * st.tokens * vocab_local
        )
    return log_probs, base + accum_grads + final_norm + (1 + loss_k) * log_probs


def _pipeline_held(
    st: _Stage, lay: Layout, run: Run, first: bool, last: bool
) -> tuple[float, float, float]:
    """What a pipeline stage holds through a step besides weights and optimizer states:
    torch's stage keeps gradients unreduced until the step's last backward (under FSDP
    unsharded, accumulated in fp32, with the parameters left gathered), and one receive
    buffer per micro-batch for the input (non-first stages) and the output gradient
    (non-last stages). Returns (gathered parameters, gradients, receive buffers)."""
    stage_local = st.layers * st.layer_local + st.root_local
    a = run.param_bytes
    params, grads = (a * stage_local, 4 * st.trained_stage_local) if lay.fsdp else (0.0, st.grads)
    boundary = st.a_in  # a micro-batch's block output
    micro = max(1, run.local_batch // run.pp_microbatch)
    buffers = micro * boundary * ((not first) + (not last))
    return params, grads, buffers


def _pipeline_backward(
    st: _Stage,
    g: Geometry,
    lay: Layout,
    run: Run,
    base: float,
    activations: float,
    first: bool,
    last: bool,
) -> float:
    """A block's backward in the pipeline's steady state: every in-flight micro-batch's
    activations, the stage's held gradients, gathered parameters and buffers, the block's
    recomputation under AC and its gradient temporaries."""
    a = run.param_bytes
    mlp_temps = st.tokens * a * (2 * _ffn_width(g, lay) + 2 * g.dim)
    temps = max(mlp_temps, _linear_backward_bytes(g, lay, st.tokens))
    temps += (a + 4) * st.trained_layer_local
    return (
        base + sum(_pipeline_held(st, lay, run, first, last)) + activations + st.recompute + temps
    )


def _layer_backward(st: _Stage, g: Geometry, lay: Layout, a: int, base: float) -> float:
    """Backward of one block: the blocks below keep their activations, the blocks above hold
    their sharded fp32 gradients; plus this block's gathered parameters and the next one's
    (prefetch), its recomputed activations under AC, gradient temporaries, its low-precision
    gradients and fp32 reduce-scatter input. Linear in the block index, so the maximum is
    at the first or the last block; with blocks of different mixers, the maximum over the
    blocks."""
    mlp_temps = st.tokens * a * (2 * _ffn_width(g, lay) + 2 * g.dim)
    linear_temps = _linear_backward_bytes(g, lay, st.tokens)
    temps = max(mlp_temps, st.ring_backward, linear_temps) + (a + 4) * st.trained_layer_local
    if st.blocks is not None:
        peak, below = 0.0, 0.0
        for i, (kept, recompute) in enumerate(st.blocks):
            above = (st.layers - 1 - i) * 4 * st.trained_layer_sharded
            peak = max(peak, base + 2 * st.u_layer + below + kept + recompute + temps + above)
            below += kept
        return peak
    current = base + 2 * st.u_layer + st.kept + st.recompute + temps
    top_block = current + (st.layers - 1) * st.kept
    bottom_block = current + (st.layers - 1) * 4 * st.trained_layer_sharded
    return max(top_block, bottom_block)


def from_job_config(
    job_config, model_args, parallel_dims, grad_accum: int, target: str
) -> tuple[Geometry | None, Layout, Run]:
    """The analytic inputs of a configured run."""
    ac = job_config.activation_checkpoint
    ac_mode = ac.mode if ac.mode != "selective" else f"selective:{ac.selective_ac_option}"
    layout = Layout(
        dp_replicate=parallel_dims.dp_replicate,
        dp_shard=parallel_dims.dp_shard,
        cp=parallel_dims.cp,
        tp=parallel_dims.tp,
        pp=parallel_dims.pp,
        ac=ac_mode,
        ep=parallel_dims.ep,
        etp=parallel_dims.etp,
    )
    training = job_config.training
    param_bytes = 4 if training.mixed_precision_param == "float32" else 2
    run = Run(
        seq_len=training.seq_len,
        local_batch=training.local_batch_size,
        grad_accum=grad_accum,
        param_bytes=param_bytes,
        foreach_optimizer=job_config.optimizer.implementation == "foreach",
        muon_ns_bytes=(
            {"bfloat16": 2, "float32": 4}[
                resolve_ns_dtype(job_config.optimizer.muon.ns_dtype, target)
            ]
            if job_config.optimizer.name == "Muon"
            else 0
        ),
        float8=any(name in FLOAT8_LINEAR for name in job_config.model.converters),
        loss_parallel=not job_config.parallelism.disable_loss_parallel,
        target=target,
        pp_microbatch=job_config.parallelism.pipeline_parallel_microbatch_size,
        pp_all_in_flight=job_config.parallelism.pipeline_parallel_schedule
        in ("GPipe", "LoopedBFS"),
        cp_rotate=parallel_dims.cp_rotate_method,
        cp_headtail=parallel_dims.cp_load_balancer == "headtail",
        ac_keeps_attention=keeps_attention_output(ac, parallel_dims.ring_cp),
    )
    geometry = model_args.geometry()
    if geometry is not None and LORA in job_config.model.converters:
        run = dataclasses.replace(run, lora=lora_from_config(job_config, geometry))
    if run.lora is None or "output" not in run.lora.adapted:  # components/training_loss.py's choice
        run = dataclasses.replace(run, loss_chunk=training.loss_chunk_size)
    return geometry, layout, run


_BLOCK_MODULE = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention"}


def lora_from_config(job_config, g: Geometry) -> LoRA:
    """The linears that ``lora.target_modules`` adapts, matched as the converter matches them
    against this geometry's FQNs; ConfigError where the closed form cannot follow."""
    if g.experts is not None or g.mla is not None or g.delta_rule is not None:
        raise ConfigError(
            f"model.converters=['lora'] on {job_config.model.name!r}: the closed form covers "
            "LoRA on dense decoders only (no Gated DeltaNet); use --memory_estimation.mode estimate"
        )
    patterns = job_config.lora.target_modules

    def adapted_in(layer: int) -> frozenset[str]:
        return frozenset(
            name
            for name in _dense_linears(g)
            if any(
                matches_target(
                    p, f"layers.{layer}.{_BLOCK_MODULE.get(name, 'feed_forward')}.{name}"
                )
                for p in patterns
            )
        )

    per_block = {adapted_in(layer) for layer in range(g.n_layers)}
    if len(per_block) > 1:
        raise ConfigError(
            "lora.target_modules: adapts different linears in different blocks, which the "
            "closed form does not model; use --memory_estimation.mode estimate"
        )
    output = {"output"} if any(matches_target(p, "output") for p in patterns) else set()
    return LoRA(job_config.lora.rank, per_block.pop() | output, uses_nf4(job_config))
