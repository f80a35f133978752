"""Step time of a decoder's training step (dense or MoE) on a GPU kind, per parallel layout:
the compute of each phase (forward, backward, the recompute of activation checkpointing) at
an achievable share of the GPU's data-sheet peak, each layout's collectives as bytes over the
links they cross, what of them hides behind compute, and the pipeline's bubble. A MoE layer
computes the ``top_k`` experts each token reaches, routing assumed balanced over the experts
(and so over the expert-parallel ranks).

No library models this (the planners of the field estimate memory only), so it is written
here. The shares of peak (``Efficiency``) are fitted once on published runs and checked on
the others (``scripts/estimate/calibrate_step_time.py``, ``benchmarks/step_time_calibration.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan.estimate.closed_form.inputs import Layout
from torchtitan.protocols.geometry import Geometry
from torchtitan.tools.peaks import gpu_peak_flops


@dataclass(frozen=True)
class DeviceKind:
    """What the model needs of a device: its dense matmul peak in the training dtype (bf16 on
    GPUs), its float8 peak, the bytes/s per direction of the links within a node (NVLink; on
    one CPU host, what gloo achieves), a collective's fixed latency, and whether
    communication runs beside compute (GPUs: copy engines and spare SMs) or takes the cores
    that compute (a CPU)."""

    name: str
    flops: float
    fp8_flops: float | None
    link_bytes_per_s: float
    collective_latency_s: float = 20e-6  # NCCL's small-message latency, order of magnitude
    overlaps_communication: bool = True


def _gpu(name: str, sheet_name: str, nvlink: float, float8: bool = True) -> DeviceKind:
    """A GPU of the bf16 table MFU divides by, with float8 at twice that where it has it."""
    bf16 = gpu_peak_flops(sheet_name)
    return DeviceKind(name, bf16, 2 * bf16 if float8 else None, nvlink)


GPU_KINDS = {
    "H100": _gpu("H100 SXM", "H100", 450e9),
    "H200": _gpu("H200 SXM", "H200", 450e9),
    "B200": _gpu("B200", "B200", 900e9),
    "A100": _gpu("A100 SXM", "A100", 300e9, float8=False),
}


@dataclass(frozen=True)
class Efficiency:
    """Achieved shares of the data-sheet peaks (see the module docstring for their origin)."""

    matmul: float  # compiled bf16 matmuls, of the bf16 peak
    float8_matmul: float  # compiled float8 linears, of the float8 peak
    attention: float  # flash attention, of the bf16 peak, on the FLOPs a causal kernel runs
    eager_slowdown: float  # eager compute time / compiled (the kernels compile fuses)
    collective: float  # achieved NCCL bus bandwidth / link bandwidth
    async_tp_hidden: float  # share of tensor-parallel traffic async TP hides behind matmuls


# Fitted on the published Llama 3.1 8B rows on 8 H100s (matmul, eager_slowdown, float8_matmul:
# one row each), the 32k-token row of the CP table (attention) and the async-TP row of the
# 70B table; collective is NCCL's typical ring bus bandwidth on NVLink and 400 Gb/s NICs.
CALIBRATED = Efficiency(
    matmul=0.4381,
    float8_matmul=0.3086,
    attention=0.2196,
    eager_slowdown=1.157,
    collective=0.8,
    async_tp_hidden=0.8657,
)

INTERLEAVED = ("Interleaved1F1B", "LoopedBFS")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class StepInputs:
    """One training step of a decoder as the step-time model sees it."""

    geometry: Geometry
    layout: Layout
    seq_len: int
    local_batch: int
    grad_accum: int = 1
    param_bytes: int = 2  # the dtype of the matmuls and of FSDP's all-gathers
    reduce_bytes: int = 4  # FSDP's reduce-scatter dtype
    compile: bool = False
    float8: bool = False  # the blocks' linears in float8 (the output layer stays bf16)
    float8_all_gather: bool = False
    async_tp: bool = False
    reshard_after_forward: bool = True
    cp_ring: bool = False  # alltoall rotation: K/V passed around a ring behind the attention
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 1
    stages_per_rank: int = 1
    device: DeviceKind = GPU_KINDS["H100"]
    gpus_per_node: int = 8
    network_bytes_per_s: float = 50e9  # per GPU between nodes (one 400 Gb/s NIC each)
    efficiency: Efficiency = CALIBRATED


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step per phase (compute includes recompute), and the rates."""

    compute: float
    recompute: float
    fsdp_exposed: float
    tensor_parallel: float
    context_parallel: float
    expert_parallel: float
    pipeline_p2p: float
    bubble: float
    total: float
    tokens_per_second_per_gpu: float
    mfu: float  # model FLOPs (the trainer's count) / bf16 peak

    def lines(self) -> list[str]:
        parts = (
            ("compute", self.compute - self.recompute),
            ("recompute (activation checkpointing)", self.recompute),
            ("exposed FSDP/HSDP communication", self.fsdp_exposed),
            ("tensor-parallel communication", self.tensor_parallel),
            ("context-parallel communication", self.context_parallel),
            ("expert-parallel all-to-all", self.expert_parallel),
            ("pipeline send/receive", self.pipeline_p2p),
            ("pipeline bubble", self.bubble),
        )
        return [
            f"  {name:<40}{seconds:9.3f} s  {seconds / self.total:6.1%}"
            for name, seconds in parts
            if seconds > 0
        ]


def attention_params(g: Geometry) -> int:
    """Weights of one block's attention projections (the query doubled with an output gate)."""
    q = g.n_heads * g.head_dim * (2 if g.output_gate else 1)
    kv = g.n_kv_heads * g.head_dim
    return g.dim * (q + 2 * kv) + g.v_dim * g.dim


def feed_forward_params(g: Geometry, moe: bool, routed_experts: int) -> int:
    """Weights of one block's feed-forward: a dense SwiGLU, or a MoE layer's router, shared
    experts (and their gate) and ``routed_experts`` of its routed SwiGLU experts."""
    if not moe:
        return 3 * g.dim * g.ffn_dim
    e = g.experts
    gate = g.dim if e.shared_gate else 0
    return (
        g.dim * e.num_experts
        + 3 * g.dim * e.shared_hidden_dim
        + gate
        + routed_experts * 3 * g.dim * e.hidden_dim
    )


def _blocks_params(g: Geometry, routed_experts: int) -> int:
    """Weights of all blocks with ``routed_experts`` of each MoE layer's routed experts
    (norms are below 0.1 %)."""
    dense = g.n_layers - g.moe_layers
    moe = g.moe_layers * feed_forward_params(g, True, routed_experts) if g.moe_layers else 0
    return g.n_layers * attention_params(g) + dense * feed_forward_params(g, False, 0) + moe


def active_block_params(g: Geometry) -> int:
    """Weights of all blocks that one token multiplies: every attention projection, the
    dense feed-forwards, and of each MoE layer its router, shared experts and ``top_k``
    routed experts."""
    return _blocks_params(g, g.experts.top_k if g.experts else 0)


def block_params(g: Geometry) -> int:
    """Weights of all blocks but the routed experts."""
    return _blocks_params(g, 0)


def routed_expert_params(g: Geometry) -> int:
    """Weights of every routed expert of every MoE layer (what expert parallel splits)."""
    if g.experts is None:
        return 0
    return g.moe_layers * g.experts.num_experts * 3 * g.dim * g.experts.hidden_dim


def embedding_params(g: Geometry) -> int:
    """The embedding and the output layer (one matrix when tied)."""
    return (1 if g.tied_embeddings else 2) * g.vocab_size * g.dim


def model_flops_per_token(g: Geometry, seq_len: int) -> float:
    """Training FLOPs per token as the trainer counts them for MFU: 6 per matmul weight a
    token reaches and the attention scores over the whole sequence,
    ``12 * layers * heads * head_dim * seq``."""
    linear = active_block_params(g) + g.vocab_size * g.dim
    return 6 * linear + 12 * g.n_layers * g.n_heads * g.head_dim * seq_len


def recompute_share(ac: str) -> tuple[float, float]:
    """(share of the blocks' linear forward, share of their attention forward) that
    activation checkpointing runs again in backward."""
    if ac == "full":
        return 1.0, 1.0
    if ac == "selective:op":
        return 0.5, 0.0  # every second matmul output is recomputed; attention is kept
    if ac.startswith("selective:"):
        every = int(ac.split(":")[1])
        return 1 / every, 1 / every
    return 0.0, 0.0


def _transfer_seconds(x: StepInputs, span: int, sent: float, collectives: float) -> float:
    """Time of ``collectives`` collectives over ``span`` consecutive ranks in which each rank
    sends ``sent`` bytes in all: a fixed latency each, and the bytes at the bus bandwidth."""
    if collectives == 0:
        return 0.0
    link = x.device.link_bytes_per_s if span <= x.gpus_per_node else x.network_bytes_per_s
    return collectives * x.device.collective_latency_s + sent / (link * x.efficiency.collective)


def ring_bytes(size: float, group: int) -> float:
    """Bytes each rank sends in a ring all-gather or reduce-scatter of ``size`` bytes."""
    return size * (group - 1) / group


def fsdp_bytes(x: StepInputs) -> tuple[float, float]:
    """(all-gather, reduce-scatter) bytes each rank sends in one step of FSDP over
    dp_shard x cp: weights gathered for forward and (resharded) again for backward, in
    float8 where the linears all-gather in float8; gradients reduce-scattered. Per
    micro-batch, except that a pipeline round gathers and reduces once for all of its
    micro-batches."""
    lay, g = x.layout, x.geometry
    group = lay.dp_shard * lay.cp
    if group == 1:
        return 0.0, 0.0
    per_rank = 1 / (lay.tp * lay.pp)
    blocks = block_params(g) * per_rank
    others = embedding_params(g) * per_rank
    experts = routed_expert_params(g) / (lay.ep * lay.etp * lay.pp)
    expert_group = group // lay.ep  # expert parallel takes the rest of dp_shard x cp
    gather_bytes = 1 if x.float8 and x.float8_all_gather else x.param_bytes
    gathered = ring_bytes(blocks * gather_bytes + others * x.param_bytes, group)
    gathered += ring_bytes(experts * x.param_bytes, expert_group)
    reduced = ring_bytes((blocks + others) * x.reduce_bytes, group)
    reduced += ring_bytes(experts * x.reduce_bytes, expert_group)
    gathers = 2 if x.reshard_after_forward else 1
    rounds = x.grad_accum  # a pipeline round gathers once for all its micro-batches
    return gathered * gathers * rounds, reduced * rounds


def hsdp_bytes(x: StepInputs) -> float:
    """Bytes each rank sends in HSDP's all-reduce of its gradient shard over dp_replicate
    (a ring all-reduce sends twice a reduce-scatter's)."""
    lay = x.layout
    if lay.dp_replicate == 1:
        return 0.0
    g, shards = x.geometry, lay.pp * lay.dp_shard * lay.cp
    shard = (block_params(g) + embedding_params(g)) / (lay.tp * shards)
    shard += routed_expert_params(g) / (lay.etp * shards)
    return 2 * ring_bytes(shard * x.reduce_bytes, lay.dp_replicate)


def microbatch_tokens(x: StepInputs) -> float:
    """Tokens of one micro-batch on one rank of the context-parallel group."""
    per_microbatch = x.local_batch / (x.pp_microbatches if x.layout.pp > 1 else 1)
    return per_microbatch * x.seq_len / x.layout.cp


def tp_bytes_per_layer(x: StepInputs) -> float:
    """Bytes each rank sends per block and micro-batch under tensor + sequence parallel:
    the attention and the feed-forward each all-gather their input and reduce-scatter their
    output in forward, the mirror in backward, and forward's again where it is recomputed.
    The all-gathers move float8 where the linears are float8."""
    lay = x.layout
    if lay.tp == 1:
        return 0.0
    activation = microbatch_tokens(x) * x.geometry.dim
    gather = 1 if x.float8 else x.param_bytes
    forward = 2 * ring_bytes(activation * gather, lay.tp) + 2 * ring_bytes(
        activation * x.param_bytes, lay.tp
    )
    linear_share, _ = recompute_share(lay.ac)
    return forward * (2 + linear_share)


def tp_bytes_outside_blocks(x: StepInputs) -> float:
    """Bytes each rank sends per micro-batch under tensor parallel outside the blocks: the
    embedding reduce-scatters its output (all-gathers its gradient) and the output projection
    all-gathers its input (reduce-scatters its gradient); a pipeline rank holds one of them."""
    lay = x.layout
    if lay.tp == 1:
        return 0.0
    activation = microbatch_tokens(x) * x.geometry.dim * x.param_bytes
    return _tp_ends(lay) * 2 * ring_bytes(activation, lay.tp)


def _tp_ends(lay: Layout) -> int:
    """The embedding and the output projection a rank holds: both, or one per pipeline end."""
    return 2 if lay.pp == 1 else 1


def cp_bytes_per_layer(x: StepInputs) -> float:
    """Bytes each rank receives per block and micro-batch under context parallel: the
    other ranks' keys and values in forward, again with their gradients in backward, and
    forward's again where attention is recomputed."""
    lay, g = x.layout, x.geometry
    if lay.cp == 1:
        return 0.0
    kv_heads = max(1, g.n_kv_heads // lay.tp)
    local_kv = 2 * microbatch_tokens(x) * kv_heads * g.head_dim * x.param_bytes
    forward = local_kv * (lay.cp - 1)
    _, attention_share = recompute_share(lay.ac)
    return forward * (3 + attention_share)


def ep_bytes_per_layer(x: StepInputs) -> float:
    """Bytes each rank sends per MoE block and micro-batch under expert parallel: each of
    its tokens' ``top_k`` copies that routes to another rank's experts (``(ep - 1) / ep`` of
    them when routing is balanced) is dispatched there and its output combined back, in
    forward, the mirror in backward, and forward's again where the block is recomputed. A
    rank routes its share of the sequence under tensor parallel, all of it under expert
    tensor parallel (the expert's shards need every token)."""
    lay, g = x.layout, x.geometry
    if lay.ep == 1:
        return 0.0
    tokens = microbatch_tokens(x) / (lay.tp if lay.etp == 1 else 1)
    dispatch = ring_bytes(tokens * g.experts.top_k * g.dim * x.param_bytes, lay.ep)
    linear_share, _ = recompute_share(lay.ac)
    return 2 * dispatch * (2 + linear_share)


def pp_bytes(x: StepInputs) -> float:
    """Bytes each rank sends per step between pipeline stages: each of its stages' outputs
    forward and input gradients backward, per micro-batch (sequence-sharded under TP)."""
    lay = x.layout
    if lay.pp == 1:
        return 0.0
    activation = microbatch_tokens(x) * x.geometry.dim * x.param_bytes / lay.tp
    return 2 * activation * x.stages_per_rank * x.pp_microbatches * x.grad_accum


def bubble_share(x: StepInputs) -> float:
    """Idle time of a pipeline rank relative to its compute: (pp - 1) micro-batch slots over
    m micro-batches, divided by the stages per rank for interleaved schedules, and by three
    for the zero-bubble ones (which fill the bubble with weight gradients)."""
    lay = x.layout
    if lay.pp == 1:
        return 0.0
    share = (lay.pp - 1) / x.pp_microbatches
    if x.pp_schedule in INTERLEAVED or x.pp_schedule in ZERO_BUBBLE:
        share /= x.stages_per_rank
    if x.pp_schedule in ZERO_BUBBLE:
        share /= 3
    return share


@dataclass(frozen=True)
class _Compute:
    seconds: float  # the whole step's compute on one rank, recompute included
    recompute: float
    attention: float  # the attention kernels' part


def _compute(x: StepInputs) -> _Compute:
    g, lay, e = x.geometry, x.layout, x.efficiency
    tokens = x.local_batch * x.grad_accum * x.seq_len / lay.cp
    shards = lay.tp * lay.pp
    block_linear = 2 * active_block_params(g) * tokens / shards  # one forward
    output = 2 * g.vocab_size * g.dim * tokens / shards
    # a causal kernel's forward: the scores and their application over half the sequence
    attention = 2 * g.n_layers * g.n_heads * g.head_dim * x.seq_len * tokens / shards
    bf16_rate = x.device.flops * e.matmul
    block_rate = bf16_rate
    if x.float8:
        if x.device.fp8_flops is None:
            raise ValueError(f"{x.device.name} has no float8 matmuls")
        block_rate = x.device.fp8_flops * e.float8_matmul
    attention_seconds = attention / (x.device.flops * e.attention)
    linear_share, attention_share = recompute_share(lay.ac)
    slowdown = 1.0 if x.compile else e.eager_slowdown
    train = 3 * (block_linear / block_rate + output / bf16_rate + attention_seconds)
    again = linear_share * block_linear / block_rate + attention_share * attention_seconds
    return _Compute(
        (train + again) * slowdown,
        again * slowdown,
        (3 + attention_share) * attention_seconds * slowdown,
    )


def step_time(x: StepInputs) -> StepTime:
    """The predicted step: compute (with recompute), plus what communication does not hide,
    plus the pipeline's bubble."""
    lay, g = x.layout, x.geometry
    work = _compute(x)
    compute = work.seconds
    layers = math.ceil(g.n_layers / lay.pp)
    microbatches = (x.pp_microbatches if lay.pp > 1 else 1) * x.grad_accum
    linear_share, attention_share = recompute_share(lay.ac)
    overlaps = x.device.overlaps_communication
    tp_collectives = 4 * (2 + linear_share) * layers + 2 * _tp_ends(lay)
    tp = _transfer_seconds(
        x,
        lay.tp,
        (tp_bytes_per_layer(x) * layers + tp_bytes_outside_blocks(x)) * microbatches,
        (tp_collectives if lay.tp > 1 else 0) * microbatches,
    )
    if x.async_tp and overlaps:
        tp *= 1 - x.efficiency.async_tp_hidden
    cp = _transfer_seconds(
        x,
        lay.cp * lay.tp,
        cp_bytes_per_layer(x) * layers * microbatches,
        (3 + attention_share if lay.cp > 1 else 0) * layers * microbatches,
    )
    if x.cp_ring and overlaps:  # passed around behind each ring step's attention
        cp = max(0.0, cp - work.attention)
    moe_layers = math.ceil(g.moe_layers / lay.pp)
    all_to_alls = 2 * (2 + linear_share) * moe_layers if lay.ep > 1 else 0
    ep = _transfer_seconds(  # not overlapped: the experts wait for their tokens
        x,
        lay.ep * lay.tp,
        ep_bytes_per_layer(x) * moe_layers * microbatches,
        all_to_alls * microbatches,
    )
    bubble = (compute + tp + cp + ep) * bubble_share(x)
    fsdp = _fsdp_seconds(x, layers)
    # one block's gathers and reductions start and end the step; the rest hides behind compute
    fsdp_exposed = max(0.0, fsdp - compute) + fsdp / (layers + 1) if overlaps else fsdp
    sends = 2 * x.stages_per_rank * microbatches if lay.pp > 1 else 0
    p2p = _transfer_seconds(x, lay.world_size, pp_bytes(x), sends)
    total = compute + tp + cp + ep + bubble + fsdp_exposed + p2p
    tokens = x.local_batch * x.grad_accum * x.seq_len * lay.dp_replicate * lay.dp_shard
    per_device = tokens / total / lay.world_size
    mfu = model_flops_per_token(g, x.seq_len) * per_device / x.device.flops
    return StepTime(
        compute, work.recompute, fsdp_exposed, tp, cp, ep, p2p, bubble, total, per_device, mfu
    )


def _fsdp_seconds(x: StepInputs, layers: int) -> float:
    """FSDP's and HSDP's traffic of a step: per round, each block and the root gather
    (once or twice) and reduce; HSDP all-reduces each once per step."""
    lay = x.layout
    gather, scatter = fsdp_bytes(x)
    units = layers + 1
    shard_span = lay.dp_shard * lay.cp * lay.tp
    gathers = 2 if x.reshard_after_forward else 1
    fsdp_collectives = (gathers + 1) * units * x.grad_accum if gather else 0
    seconds = _transfer_seconds(x, shard_span, gather + scatter, fsdp_collectives)
    replicas = units if lay.dp_replicate > 1 else 0
    return seconds + _transfer_seconds(x, lay.dp_replicate * shard_span, hsdp_bytes(x), replicas)
