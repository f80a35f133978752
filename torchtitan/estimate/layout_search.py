"""Layout planning: enumerate every parallel layout of a model on N GPUs, keep those whose
analytic per-GPU memory fits, and rank them by a simple throughput model.

The throughput model (rough, for ranking only): compute at a fixed fraction of bf16 peak;
FSDP/HSDP traffic overlaps compute and only its excess is exposed; tensor- and
context-parallel traffic is exposed; pipeline parallel adds its bubble. Groups that fit in a
node use NVLink bandwidth, others the inter-node bandwidth (mesh order pp, dp_replicate,
dp_shard, cp, tp with tp innermost, as ParallelDims builds it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan.estimate.closed_form.inputs import Layout, Run
from torchtitan.estimate.closed_form.peak import estimate_peak
from torchtitan.estimate.report import GiB
from torchtitan.protocols.geometry import Geometry

EFFECTIVE_FLOPS = 400e12  # per GPU: about 40 % of H100/H200 dense bf16 peak
INTRA_NODE_BYTES_PER_S = 400e9
INTER_NODE_BYTES_PER_S = 50e9  # per GPU (one 400 Gb/s NIC each)
AC_MODES = ("none", "full")
MAX_PP_FOR_PLAN = 16


@dataclass(frozen=True)
class PlanRequest:
    geometry: Geometry
    seq_len: int
    global_batch: int
    world_size: int
    device_memory_gib: float
    gpus_per_node: int
    param_bytes: int = 2
    overhead_bytes: float = 0.0
    """Per-GPU additions beyond allocations (context, workspaces, NCCL)."""
    reserved_margin: float = 0.15


@dataclass
class PlanEntry:
    layout: Layout
    local_batch: int
    grad_accum: int
    peak_bytes: int
    need_bytes: int
    step_seconds: float
    tokens_per_second_per_gpu: float


class PlanError(ValueError):
    """An impossible planning request (message: one line)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(req: PlanRequest) -> list[Layout]:
    g, n = req.geometry, req.world_size
    out = []
    for tp in _divisors(n):
        if tp > req.gpus_per_node or g.n_heads % tp or g.n_kv_heads % tp:
            continue
        for cp in _divisors(n // tp):
            if tp * cp > req.gpus_per_node or req.seq_len % (2 * cp * tp):
                continue
            for pp in _divisors(n // (tp * cp)):
                if pp > min(MAX_PP_FOR_PLAN, g.n_layers):
                    continue
                dp = n // (tp * cp * pp)
                for shard in _divisors(dp):
                    for ac in AC_MODES:
                        out.append(Layout(dp // shard, shard, cp, tp, pp, ac))
    return out


def _need(req: PlanRequest, peak: int) -> int:
    return int(peak * (1 + req.reserved_margin) + req.overhead_bytes)


def _best_batch(req: PlanRequest, lay: Layout) -> PlanEntry | None:
    """The largest local batch (fewest accumulation steps) that fits, or None."""
    dp = lay.dp_replicate * lay.dp_shard
    if req.global_batch % dp:
        return None
    per_dp = req.global_batch // dp
    for local in sorted(_divisors(per_dp), reverse=True):
        if lay.pp > 1 and local < lay.pp:
            continue
        run = Run(
            seq_len=req.seq_len,
            local_batch=local,
            grad_accum=per_dp // local,
            param_bytes=req.param_bytes,
        )
        peak = estimate_peak(req.geometry, lay, run).peak_bytes
        if _need(req, peak) <= req.device_memory_gib * GiB:
            seconds = step_seconds(req, lay, local, per_dp // local)
            tokens = req.global_batch * req.seq_len
            return PlanEntry(
                lay,
                local,
                per_dp // local,
                peak,
                _need(req, peak),
                seconds,
                tokens / seconds / req.world_size,
            )
    return None


def _bandwidth(req: PlanRequest, span: int) -> float:
    return INTRA_NODE_BYTES_PER_S if span <= req.gpus_per_node else INTER_NODE_BYTES_PER_S


def _params(g: Geometry) -> tuple[int, int]:
    """(all parameters, non-embedding parameters)."""
    q, kv = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    layer = g.dim * (2 * q + 2 * kv) + 3 * g.dim * g.ffn_dim + 2 * g.dim
    embed = g.vocab_size * g.dim
    return g.n_layers * layer + 2 * embed + g.dim, g.n_layers * layer + embed + g.dim


def step_seconds(req: PlanRequest, lay: Layout, local_batch: int, accum: int) -> float:
    g, a = req.geometry, req.param_bytes
    total, non_embed = _params(g)
    tokens = req.global_batch * req.seq_len
    attention = 12 * g.n_layers * g.n_heads * g.head_dim * req.seq_len
    flops = tokens * (6 * non_embed + attention)
    if lay.ac == "full":
        flops *= 4 / 3  # the forward runs twice
    compute = flops / (req.world_size * EFFECTIVE_FLOPS)

    tp, cp, pp = lay.tp, lay.cp, lay.pp
    shards = lay.dp_shard * cp
    params_local = total / (tp * pp)
    fsdp = 0.0
    if shards > 1:
        volume = (2 * a + 4) * params_local * (shards - 1) / shards * accum
        fsdp += volume / _bandwidth(req, shards * tp)
    if lay.dp_replicate > 1:
        grads = 4 * params_local / shards
        volume = 2 * grads * (lay.dp_replicate - 1) / lay.dp_replicate * accum
        fsdp += volume / _bandwidth(req, lay.dp_replicate * shards * tp)
    exposed = max(0.0, fsdp - compute)

    layers_local = math.ceil(g.n_layers / pp)
    tokens_local = local_batch * req.seq_len / cp * accum
    passes = 3 if lay.ac == "full" else 2
    tp_comm = 0.0
    if tp > 1:
        per_layer = 4 * a * tokens_local * g.dim * (tp - 1) / tp
        tp_comm = passes * layers_local * per_layer / _bandwidth(req, tp)
    cp_comm = 0.0
    if cp > 1:
        kv_bytes = 2 * a * tokens_local * g.n_kv_heads * g.head_dim / tp
        cp_comm = passes * layers_local * kv_bytes * (cp - 1) / _bandwidth(req, cp * tp)
    bubble = 0.0
    if pp > 1:
        microbatches = local_batch * accum
        bubble = (pp - 1) / (microbatches + pp - 1)
    return compute / (1 - bubble) + exposed + tp_comm + cp_comm


def candidate_layouts(req: PlanRequest) -> list[Layout]:
    """Every layout of the request whose data-parallel degree divides the global batch."""
    _check_request(req)
    layouts = _layouts(req)
    if not layouts:
        raise PlanError(
            f"no parallel layout of {req.world_size} GPUs suits this model and training.seq_len "
            f"{req.seq_len} (tensor/context parallel must divide the heads and seq_len / 2)"
        )
    valid = [lay for lay in layouts if req.global_batch % (lay.dp_replicate * lay.dp_shard) == 0]
    if not valid:
        raise PlanError(
            f"training.global_batch_size ({req.global_batch}) is not divisible by the "
            f"data-parallel degree of any layout of {req.world_size} GPUs; use a multiple of "
            f"{_smallest_dp(layouts)} (or more sequences)"
        )
    return valid


def fitting_entries(req: PlanRequest, layouts: list[Layout]) -> list[PlanEntry]:
    """The analytic pass: each layout that fits at its largest local batch, ranked by
    modelled throughput."""
    entries = [e for e in (_best_batch(req, lay) for lay in layouts) if e is not None]
    entries.sort(key=lambda e: e.tokens_per_second_per_gpu, reverse=True)
    return entries


def _smallest_dp(layouts: list[Layout]) -> int:
    return min(lay.dp_replicate * lay.dp_shard for lay in layouts)


def smallest_need(req: PlanRequest) -> tuple[int, Layout] | None:
    """The least per-GPU memory over all layouts at local batch 1 (for the 'nothing fits' line)."""
    best = None
    for lay in _layouts(req):
        run = Run(seq_len=req.seq_len, local_batch=1, param_bytes=req.param_bytes)
        need = _need(req, estimate_peak(req.geometry, lay, run).peak_bytes)
        if best is None or need < best[0]:
            best = (need, lay)
    return best


def _check_request(req: PlanRequest) -> None:
    if req.world_size < 1:
        raise PlanError(f"memory_estimation.world_size must be >= 1, got {req.world_size}")
    if req.global_batch < 1:
        raise PlanError(f"training.global_batch_size must be >= 1, got {req.global_batch}")
