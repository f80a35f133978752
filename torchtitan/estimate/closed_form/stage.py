"""The byte counts of one pipeline stage on one rank: its parameters (what it stores, what
it gathers), what trains, optimizer states and the blocks' activations."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan.components.adapters.qlora import (
    NF4_BYTES_PER_VALUE,
    QUANTIZE_BYTES_PER_VALUE,
    QUANTIZE_SCRATCH_BYTES,
)
from torchtitan.estimate.closed_form.attention import ring_backward_bytes
from torchtitan.estimate.closed_form.blocks import block_activations
from torchtitan.estimate.closed_form.inputs import Layout, Run
from torchtitan.estimate.closed_form.shapes import (
    NF4Bases,
    block_adapter_shapes,
    local_numel,
    mean_block_numel,
    muon_block_sharded,
    nf4_bases,
    root_adapter_shapes,
    root_shapes,
)
from torchtitan.protocols.geometry import Geometry


@dataclass
class Stage:
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


@dataclass(frozen=True)
class StageNumel:
    """Parameter counts of a stage: TP-local (gathered) and FSDP-sharded (stored); what
    trains is everything, or under LoRA the adapters (which add to the block and root)."""

    layer_local: float  # the mean block, adapters included
    layer_sharded: float  # the mean block's base
    largest_layer: float  # the largest block, adapters included
    root_local: float
    params_sharded: float
    trained_layer_local: float
    trained_layer_sharded: float
    trained_stage_local: float
    trained_sharded: float


def stage_numel(
    g: Geometry, lay: Layout, run: Run, layers: int, first: bool, last: bool
) -> StageNumel:
    layer_local, layer_sharded, largest_layer = mean_block_numel(g, lay)
    root_local, root_sharded = local_numel(root_shapes(g, first, last), lay)
    params_sharded = layers * layer_sharded + root_sharded
    trained_layer, trained_root = (layer_local, layer_sharded), (root_local, root_sharded)
    if run.lora is not None:
        trained_layer = local_numel(block_adapter_shapes(g, run.lora), lay)
        trained_root = local_numel(root_adapter_shapes(g, run.lora, last), lay)
        layer_local, largest_layer = (
            layer_local + trained_layer[0],
            largest_layer + trained_layer[0],
        )
        root_local += trained_root[0]
        params_sharded += layers * trained_layer[1] + trained_root[1]
    return StageNumel(
        layer_local=layer_local,
        layer_sharded=layer_sharded,
        largest_layer=largest_layer,
        root_local=root_local,
        params_sharded=params_sharded,
        trained_layer_local=trained_layer[0],
        trained_layer_sharded=trained_layer[1],
        trained_stage_local=layers * trained_layer[0] + trained_root[0],
        trained_sharded=layers * trained_layer[1] + trained_root[1],
    )


def _gathered_bytes(
    g: Geometry,
    lay: Layout,
    run: Run,
    layers: int,
    numel: StageNumel,
    nf4: NF4Bases,
    last: bool,
) -> tuple[float, float, float]:
    """(one block's gathered parameters, the root's, the low-precision copies of frozen
    weights that every block keeps for backward). QLoRA's NF4 bases are dequantized to one
    low-precision weight at a time inside their matmuls."""
    a = run.param_bytes
    dequantized, nf4_saving = a * nf4.largest, a - NF4_BYTES_PER_VALUE
    if lay.fsdp:
        u_layer = a * numel.largest_layer - nf4_saving * nf4.layer_local + dequantized
        return u_layer, a * numel.root_local - nf4_saving * nf4.root_local, 0.0
    if a == 4:
        return dequantized, 0, 0.0
    if run.lora is None:  # autocast caches low-precision copies of the weights for the step
        return 0, (layers * numel.layer_local + numel.root_local) * a, 0.0
    # it caches only trainable weights; a frozen linear's backward keeps its own copy (an
    # NF4 base keeps itself: it is dequantized again in backward)
    output_copy = 0 if nf4.root_local else a * g.vocab_size * g.dim / lay.tp
    u_root = a * numel.trained_stage_local + (output_copy if last else 0)
    frozen_copies = a * (numel.layer_local - numel.trained_layer_local - nf4.layer_local)
    return dequantized, u_root, frozen_copies


def _base_load(weights: float, nf4: NF4Bases) -> float:
    """QLoRA's start (components/qlora.PendingBase), bounded at its last block: the NF4 base,
    that block in fp32 (shards) and one gathered weight being quantized. (A Hugging Face
    load's transient, the full value read and cast to fp32, is smaller: 6-8 bytes per value
    of one weight against quantization's 9.6.) 0 without NF4 bases."""
    if not nf4.largest:
        return 0
    return (
        weights
        + 4 * nf4.group_sharded
        + QUANTIZE_BYTES_PER_VALUE * nf4.largest
        + QUANTIZE_SCRATCH_BYTES
    )


def stage_sizes(g: Geometry, lay: Layout, run: Run, first: bool, last: bool) -> Stage:
    layers = math.ceil(g.n_layers / lay.pp)
    batch = run.pp_microbatch if lay.pp > 1 else run.local_batch
    tokens = batch * run.seq_len / lay.cp
    numel = stage_numel(g, lay, run, layers, first, last)
    nf4 = nf4_bases(g, lay, run, layers, last)
    u_layer, u_root, frozen_copies = _gathered_bytes(g, lay, run, layers, numel, nf4, last)
    a_in, a_layer, kept, recompute, blocks = block_activations(g, lay, run, tokens, frozen_copies)
    weights = 4 * numel.params_sharded - (4 - NF4_BYTES_PER_VALUE) * nf4.stage_sharded
    muon_matrices = layers * muon_block_sharded(g, lay) if run.muon_ns_bytes else 0
    # Adam's two moments in optimizer.state_dtype; Muon's one fp32 momentum per block matrix
    optimizer_states = 2 * run.state_bytes * (numel.trained_sharded - muon_matrices)
    optimizer_states += 4 * muon_matrices
    return Stage(
        weights=weights,
        grads=4 * numel.trained_sharded,
        opt=optimizer_states,
        u_layer=u_layer,
        u_root=u_root,
        root_local=numel.root_local,
        layer_local=numel.layer_local,
        layer_sharded=numel.layer_sharded,
        trained_layer_local=numel.trained_layer_local,
        trained_layer_sharded=numel.trained_layer_sharded,
        trained_stage_local=numel.trained_stage_local,
        layers=layers,
        tokens=tokens,
        a_in=a_in,
        a_layer=a_layer,
        kept=kept,
        recompute=recompute,
        ring_backward=ring_backward_bytes(g, lay, run, batch, tokens),
        base_load=_base_load(weights, nf4),
        blocks=blocks,
    )
