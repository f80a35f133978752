"""Layout planning: enumerate every parallel layout of a model on N GPUs, keep those whose
analytic per-GPU memory fits, and rank them by the step-time model (``step_time``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.estimate.closed_form.inputs import Layout, Run
from torchtitan.estimate.closed_form.peak import estimate_peak
from torchtitan.estimate.report import GiB
from torchtitan.estimate.step_time import GPU_KINDS, DeviceKind, StepInputs, StepTime, step_time
from torchtitan.protocols.geometry import Geometry

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
    reduce_bytes: int = 4
    compile: bool = False
    gpu: DeviceKind = GPU_KINDS["H100"]
    network_bytes_per_s: float = 50e9
    run_settings: Run | None = None
    """The configured run's settings that no layout changes (the loss chunk, the optimizer's
    kernels and state dtype, the CP rotation); None: ``Run``'s defaults."""

    def run(self, local_batch: int, grad_accum: int = 1) -> Run:
        """The closed form's run of one layout at this batch."""
        return dataclasses.replace(
            self.run_settings or Run(self.seq_len, local_batch),
            seq_len=self.seq_len,
            local_batch=local_batch,
            grad_accum=grad_accum,
            param_bytes=self.param_bytes,
        )


@dataclass
class PlanEntry:
    layout: Layout
    local_batch: int
    grad_accum: int
    peak_bytes: int
    need_bytes: int
    time: StepTime

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.time.tokens_per_second_per_gpu


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
                    for ep, etp in _expert_layouts(g, shard * cp, cp, tp):
                        for ac in AC_MODES:
                            out.append(Layout(dp // shard, shard, cp, tp, pp, ac, ep, etp))
    return out


def _expert_layouts(g: Geometry, shard_cp: int, cp: int, tp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs of a MoE model: expert parallel over a multiple of cp dividing
    dp_shard x cp and the experts, with or without expert tensor parallel over tp."""
    if g.experts is None:
        return [(1, 1)]
    eps = [ep for ep in _divisors(shard_cp) if ep % cp == 0 and g.experts.num_experts % ep == 0]
    tensor_parallel = (1, tp) if tp > 1 else (1,)
    return [(1, 1)] + [(ep, etp) for ep in eps if ep > 1 for etp in tensor_parallel]


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
        peak = estimate_peak(req.geometry, lay, req.run(local, per_dp // local)).peak_bytes
        if _need(req, peak) <= req.device_memory_gib * GiB:
            time = step_seconds(req, lay, local, per_dp // local)
            return PlanEntry(lay, local, per_dp // local, peak, _need(req, peak), time)
    return None


def step_seconds(req: PlanRequest, lay: Layout, local_batch: int, accum: int) -> StepTime:
    """The step-time model's prediction for a layout at this batch (pipelines: micro-batches
    of one sequence, 1F1B)."""
    return step_time(
        StepInputs(
            geometry=req.geometry,
            layout=lay,
            seq_len=req.seq_len,
            local_batch=local_batch,
            grad_accum=accum,
            param_bytes=req.param_bytes,
            reduce_bytes=req.reduce_bytes,
            compile=req.compile,
            reshard_after_forward=lay.pp == 1,
            pp_microbatches=local_batch,
            device=req.gpu,
            gpus_per_node=req.gpus_per_node,
            network_bytes_per_s=req.network_bytes_per_s,
        )
    )


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
        need = _need(req, estimate_peak(req.geometry, lay, req.run(1)).peak_bytes)
        if best is None or need < best[0]:
            best = (need, lay)
    return best


def _check_request(req: PlanRequest) -> None:
    if req.world_size < 1:
        raise PlanError(f"memory_estimation.world_size must be >= 1, got {req.world_size}")
    if req.global_batch < 1:
        raise PlanError(f"training.global_batch_size must be >= 1, got {req.global_batch}")
