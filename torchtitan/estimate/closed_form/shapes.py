"""The weights of a block and of the root (embedding, final norm, output) as (rows, cols, tp
style) shapes, and their parameter counts on one rank: TP/EP-local (what a block gathers)
and FSDP-sharded (what a rank stores)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan.estimate.closed_form.inputs import Layout, LoRA, Run
from torchtitan.protocols.geometry import DeltaRuleMixer, Geometry, LatentAttention

Shape = tuple[int, int, str]
"""(rows, cols, tp style): "col" shards rows over tp, "row" cols, "exp" rows over expert
parallel (and their hidden size over expert tensor parallel), "rep" is replicated."""


def dense_linears(g: Geometry) -> dict[str, Shape]:
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


def _attention_shapes(g: Geometry) -> list[Shape]:
    """One block's attention weights (and per-head q/k norms)."""
    if g.mla is not None:
        return _latent_attention_shapes(g, g.mla)
    linears = dense_linears(g)
    shapes = [linears[name] for name in ("wq", "wk", "wv", "wo")]
    if g.qk_norm:
        shapes += [(g.head_dim, 1, "rep"), (g.head_dim, 1, "rep")]
    return shapes


def _latent_attention_shapes(g: Geometry, mla: LatentAttention) -> list[Shape]:
    """Queries from the input or through a normalised latent; keys and values through a
    normalised latent shared by the heads (with the rotary key channels), then wo."""
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


def _delta_rule_shapes(d: DeltaRuleMixer, dim: int) -> list[Shape]:
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
    """A dense SwiGLU, or a router, the routed experts, the shared experts and their gate."""
    if not moe:
        linears = dense_linears(g)
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


def block_shapes(g: Geometry, moe: bool, delta_rule: bool = False) -> list[Shape]:
    """A block: its token mixer (attention or Gated DeltaNet), feed-forward and two norms."""
    mixer = _delta_rule_shapes(g.delta_rule, g.dim) if delta_rule else _attention_shapes(g)
    return mixer + _ffn_shapes(g, moe) + [(g.dim, 1, "rep"), (g.dim, 1, "rep")]


def root_shapes(g: Geometry, first: bool, last: bool) -> list[Shape]:
    """The embedding on the first stage; the final norm and (untied) output on the last."""
    shapes = [(g.vocab_size, g.dim, "col")] if first else []
    if last:
        shapes += [(g.dim, 1, "rep")] + (
            [] if g.tied_embeddings else [(g.vocab_size, g.dim, "col")]
        )
    return shapes


def local_numel(shapes: list[Shape], lay: Layout) -> tuple[int, int]:
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


def mean_block_numel(g: Geometry, lay: Layout) -> tuple[float, float, int]:
    """(local numel, FSDP-sharded numel) of the mean block over the model's kinds of block
    (dense and MoE; attention and Gated DeltaNet), and the largest block's local numel (what
    one block gathers)."""
    kinds = [
        (share, local_numel(block_shapes(g, moe, delta_rule), lay))
        for share, delta_rule, moe in g.block_kinds()
    ]
    local = sum(share * numel[0] for share, numel in kinds)
    sharded = sum(share * numel[1] for share, numel in kinds)
    return local, sharded, max(numel[0] for _, numel in kinds)


def muon_block_sharded(g: Geometry, lay: Layout) -> float:
    """FSDP-sharded numel of the mean block's weight matrices (what Muon trains)."""
    return sum(
        share * local_numel([s for s in block_shapes(g, moe, delta_rule) if s[1] > 1], lay)[1]
        for share, delta_rule, moe in g.block_kinds()
    )


def _adapter_shapes(shape: Shape, rank: int) -> list[Shape]:
    """lora_a [rank, in] and lora_b [out, rank] as tensor parallel places them: for a
    rowwise base A is sharded like its input and B replicated, otherwise A is replicated and
    B sharded like its output."""
    rows, cols, style = shape
    if style == "row":
        return [(rank, cols, "row"), (rows, rank, "rep")]
    return [(rank, cols, "rep"), (rows, rank, style)]


def block_adapter_shapes(g: Geometry, lora: LoRA | None) -> list[Shape]:
    if lora is None:
        return []
    linears = dense_linears(g)
    return [
        s
        for n in sorted(lora.adapted & linears.keys())
        for s in _adapter_shapes(linears[n], lora.rank)
    ]


def root_adapter_shapes(g: Geometry, lora: LoRA | None, last: bool) -> list[Shape]:
    if lora is None or not last or "output" not in lora.adapted:
        return []
    return _adapter_shapes((g.vocab_size, g.dim, "col"), lora.rank)


@dataclass(frozen=True)
class NF4Bases:
    """QLoRA's NF4 base weights on a stage (all 0 without): TP-local numel per block and of
    the root, the stage's FSDP-sharded numel, the largest one (dequantized one at a time)
    and the largest group made at once at the start (a block, or the root's)."""

    layer_local: float = 0
    root_local: float = 0
    stage_sharded: float = 0
    largest: float = 0
    group_sharded: float = 0


def nf4_bases(g: Geometry, lay: Layout, run: Run, layers: int, last: bool) -> NF4Bases:
    """The base weights of the adapted linears, stored as NF4 under QLoRA."""
    if run.lora is None or not run.lora.nf4:
        return NF4Bases()
    linears = dense_linears(g)
    block = [linears[n] for n in sorted(run.lora.adapted & linears.keys())]
    root = [(g.vocab_size, g.dim, "col")] if last and "output" in run.lora.adapted else []
    (layer_local, layer_sharded), (root_local, root_sharded) = (
        local_numel(block, lay),
        local_numel(root, lay),
    )
    largest = max((local_numel([s], lay)[0] for s in block + root), default=0)
    return NF4Bases(
        layer_local,
        root_local,
        layers * layer_sharded + root_sharded,
        largest,
        max(layer_sharded, root_sharded),
    )
