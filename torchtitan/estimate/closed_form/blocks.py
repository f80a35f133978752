"""What a block keeps for backward: without activation checkpointing (its norms, token mixer,
feed-forward and adapters), and under full or every-N selective AC, which keeps a block's
input and rebuilds the rest in its backward."""

from __future__ import annotations

from torchtitan.estimate.closed_form.attention import (
    attention_kept_per_token,
    attention_mask_bytes,
    projection_kept_per_token,
    recomputed_attention_keeps,
)
from torchtitan.estimate.closed_form.delta_rule import delta_rule_kept_per_token
from torchtitan.estimate.closed_form.feed_forward import ffn_kept_per_token
from torchtitan.estimate.closed_form.inputs import Layout, LoRA, Run
from torchtitan.estimate.closed_form.norms import model_norm_kept_bytes
from torchtitan.protocols.geometry import Geometry

MixerKinds = list[tuple[float, bool, float]]
"""(share of the blocks, Gated DeltaNet mixer, what such a block keeps without AC) for each
kind of token mixer of the model."""


def _mixer_kept_per_token(g: Geometry, lay: Layout, run: Run, a: int, delta_rule: bool) -> float:
    """An attention mixer (q, k, v, output, projections, fp32 log-sum-exp) or a Gated
    DeltaNet one."""
    if delta_rule:
        return delta_rule_kept_per_token(g, lay, run, a)
    return (
        attention_kept_per_token(g, lay, run, a)
        + projection_kept_per_token(g, lay, run.target, a)
        + 4 * g.n_heads / lay.tp  # logsumexp
    )


def _mean_ffn_kept_per_token(g: Geometry, lay: Layout, a: int, lora: LoRA | None) -> float:
    """The mean over the model's dense and MoE feed-forwards."""
    moe_share = g.moe_layers / g.n_layers
    return (1 - moe_share) * ffn_kept_per_token(g, lay, a, False, lora) + moe_share * (
        ffn_kept_per_token(g, lay, a, True, lora) if g.experts else 0
    )


def layer_activation_bytes(
    g: Geometry, lay: Layout, run: Run, a: int, tokens: float, delta_rule: bool = False
) -> float:
    """What one block keeps without AC (the mean over the model's dense and MoE blocks),
    with an attention or (``delta_rule``) a Gated DeltaNet mixer."""
    sp = lay.tp  # sequence parallel shards the residual stream when TP is on
    lora = run.lora
    ffn = _mean_ffn_kept_per_token(g, lay, a, lora)
    mixer = _mixer_kept_per_token(g, lay, run, a, delta_rule)
    # the norm outputs (all-gathered under SP), saved by the projections that take them
    norm_outputs = (
        2
        if lora is None
        else (lora.keeps_input(("wq", "wk", "wv")) + lora.keeps_input(("w1", "w3")))
    )
    adapters = 0 if lora is None else len(lora.adapted - {"output"})
    per_token = (
        2 * model_norm_kept_bytes(g, a, g.dim, run.target) / sp  # attention_norm, ffn_norm
        + norm_outputs * a * g.dim
        + adapters * a * (lora.rank if lora else 0)  # each adapter's [tokens, rank] middle
        + mixer
        + ffn
    )
    return tokens * per_token + (0 if delta_rule else attention_mask_bytes(lay, run, a))


def mixer_activation_bytes(g: Geometry, lay: Layout, run: Run, a: int, tokens: float) -> MixerKinds:
    """What one block of each kind of token mixer keeps without AC (the feed-forward: the
    mean over dense and MoE)."""
    delta_rule_share = g.delta_rule_layers / g.n_layers
    return [
        (share, delta_rule, layer_activation_bytes(g, lay, run, a, tokens, delta_rule))
        for share, delta_rule in ((1 - delta_rule_share, False), (delta_rule_share, True))
        if share > 0
    ]


def _ac_kept(
    g: Geometry, lay: Layout, run: Run, tokens: float, a_in: float, mixers: MixerKinds
) -> tuple[float, float]:
    """(what one block keeps under the configured AC, the mean over the blocks; what the
    recompute of the largest block rebuilds). A recomputed attention block may keep its
    attention output (only attention kernels are kept, none in Gated DeltaNet blocks)."""
    kept_out = {False: recomputed_attention_keeps(g, lay, run, tokens), True: 0.0}
    a_layer = sum(share * a_kind for share, _, a_kind in mixers)
    attention_kept = sum(share * kept_out[delta_rule] for share, delta_rule, _ in mixers)
    recompute = max(a_kind - kept_out[delta_rule] for _, delta_rule, a_kind in mixers)
    if lay.ac == "full":
        return a_in + attention_kept, recompute
    if lay.ac.startswith("selective:"):
        every = int(lay.ac.split(":")[1])
        return (a_layer * (every - 1) + a_in + attention_kept) / every, recompute
    return a_layer, 0.0


def _hybrid_blocks(
    g: Geometry, lay: Layout, run: Run, tokens: float, a_in: float, mixers: MixerKinds
) -> list[tuple[float, float]] | None:
    """(what the block keeps under the configured AC, what its recompute rebuilds) of each
    block in order, for a model of Gated DeltaNet and attention blocks on one pipeline stage
    (None otherwise): which blocks every-N selective AC recomputes depends on their mixer."""
    if g.delta_rule is None or lay.pp > 1:
        return None
    a_kind = {delta_rule: a for _, delta_rule, a in mixers}
    kept_out = recomputed_attention_keeps(g, lay, run, tokens)
    every = int(lay.ac.split(":")[1]) if lay.ac.startswith("selective:") else 1
    blocks = []
    for i in range(g.n_layers):
        delta_rule = i in g.delta_rule.layer_ids
        if lay.ac == "none" or (i + 1) % every:
            blocks.append((a_kind[delta_rule], 0.0))
        else:
            out = 0.0 if delta_rule else kept_out
            blocks.append((a_in + out, a_kind[delta_rule] - out))
    return blocks


def block_activations(
    g: Geometry, lay: Layout, run: Run, tokens: float, frozen_copies: float
) -> tuple[float, float, float, float, list[tuple[float, float]] | None]:
    """A block's input bytes, its mean activation bytes, what AC keeps of a block and the
    largest recompute, and the per-block (kept, recompute) of hybrid stacks (or None).
    ``frozen_copies``: what every block keeps of its frozen weights (LoRA without FSDP)."""
    a = run.param_bytes
    # a block's input: the residual stream, fp32 without FSDP (autocast keeps fp32 weights)
    a_in = (a if lay.fsdp else 4) * tokens * g.dim / lay.tp
    mixers = [
        (share, delta_rule, a_kind + frozen_copies)
        for share, delta_rule, a_kind in mixer_activation_bytes(g, lay, run, a, tokens)
    ]
    a_layer = sum(share * a_kind for share, _, a_kind in mixers)
    kept, recompute = _ac_kept(g, lay, run, tokens, a_in, mixers)
    blocks = _hybrid_blocks(g, lay, run, tokens, a_in, mixers)
    if blocks is not None:
        kept = sum(k for k, _ in blocks) / len(blocks)
        recompute = max(r for _, r in blocks)
    return a_in, a_layer, kept, recompute, blocks
