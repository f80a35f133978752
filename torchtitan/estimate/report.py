"""Text report of an estimate: the traced allocated peak and its breakdown, where it happens,
the analytic cross-check, and what a CUDA device adds that tracing cannot see."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.estimate.closed_form.peak import AnalyticEstimate
from torchtitan.estimate.memory_tracker import TrackerResult

GiB = 2**30
MiB = 2**20

ANALYTIC_WARN_FRACTION = 0.03
"""Warn when the analytic estimate and the trace differ by more than this."""

CUBLAS_WORKSPACE_BYTES = 64 * MiB
"""Two cuBLAS workspaces of 32 MiB (Hopper; one per stream handle: forward thread and autograd
thread). They go through the caching allocator but never through Python dispatch."""

CUDA_CONTEXT_BYTES = int(0.82 * GiB)
"""Device memory outside PyTorch's allocator (CUDA context, kernel images), measured on an H200."""

# Tracker categories -> report headings (both MemTracker and FSDPMemTracker names).
_HEADINGS = {
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Parameter": "parameters",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Gradient": "gradients",
    "OptState": "optimizer states",
    "Optstate": "optimizer states",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "communication buffers",
    "Reduce Scatter": "communication buffers",
    "Buffer": "buffers and inputs",
    "Inputs": "buffers and inputs",
    "Other": "buffers and inputs",
}
_HEADING_ORDER = [
    "parameters",
    "gradients",
    "optimizer states",
    "activations",
    "temporaries",
    "communication buffers",
    "buffers and inputs",
]
TOP_MODULES = 6


@dataclass
class DeviceAdditions:
    """What a CUDA rank needs beyond the traced allocations, each item separately."""

    items: list[tuple[str, int]]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items)


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def unit_for(peak: int) -> tuple[str, int]:
    """GiB for real models, MiB for the small debug ones."""
    return ("GiB", GiB) if peak >= GiB else ("MiB", MiB)


def _fmt(n: float, unit: tuple[str, int]) -> str:
    return f"{n / unit[1]:.2f}"


def size(n: int, reference: int | None = None) -> str:
    """``n`` with the unit that suits ``reference`` (default ``n``): '69.14 GiB', '35.20 MiB'."""
    unit = unit_for(n if reference is None else reference)
    return f"{_fmt(n, unit)} {unit[0]}"


def device_additions(
    allocated: int, world_size: int, reserved_margin: float, nccl_gib: float
) -> DeviceAdditions:
    items = [
        ("cuBLAS workspaces (2 x 32 MiB on sm90)", CUBLAS_WORKSPACE_BYTES),
        ("CUDA context and kernels (measured on an H200)", CUDA_CONTEXT_BYTES),
        (
            f"caching-allocator reserve, {reserved_margin:.0%} of allocated "
            "(memory_estimation.reserved_margin)",
            int(reserved_margin * (allocated + CUBLAS_WORKSPACE_BYTES)),
        ),
    ]
    if world_size > 1:
        items.append(
            (
                "NCCL buffers, stated allowance (memory_estimation.nccl_allowance_gib)",
                int(nccl_gib * GiB),
            )
        )
    return DeviceAdditions(items)


def heading_of(category: str) -> str:
    """The report heading of a tracker category (unknown ones count as buffers and inputs)."""
    return _HEADINGS.get(category, "buffers and inputs")


def heading_totals(breakdown: dict[str, int]) -> dict[str, int]:
    """Bytes per report heading, every heading in report order."""
    totals = dict.fromkeys(_HEADING_ORDER, 0)
    for category, nbytes in breakdown.items():
        totals[heading_of(category)] += nbytes
    return totals


def breakdown_lines(result: TrackerResult) -> list[str]:
    unit = unit_for(result.peak_bytes)
    groups: dict[str, dict[str, int]] = {}
    for category, nbytes in result.breakdown.items():
        groups.setdefault(heading_of(category), {})[category] = nbytes
    lines = [f"  breakdown at the peak                      {unit[0]:>10}"]
    for heading in _HEADING_ORDER:
        parts = groups.get(heading, {})
        shown = {k: v for k, v in parts.items() if v}
        detail = (
            ", ".join(f"{k.lower()} {_fmt(v, unit)}" for k, v in shown.items())
            if len(shown) > 1
            else ""
        )
        lines.append(
            f"    {heading:<40}{_fmt(sum(parts.values()), unit):>9}"
            + (f"   ({detail})" if detail else "")
        )
    return lines


def where_line(result: TrackerResult) -> str:
    place = result.place
    if place.phase == "backward" and place.module is None:
        spot = "backward, in the loss (cross-entropy backward, before any module's backward)"
    elif place.module is not None:
        spot = f"{place.phase}, in {place.module}"
    else:
        spot = place.phase
    return f"  set in step {place.iteration}: {spot}"


def step_phases(result: TrackerResult) -> list[str]:
    """The phases of the peak's step in order, without setup, done and zero_grad."""
    return [
        phase
        for iteration, phase in result.phase_peaks
        if iteration == result.place.iteration and phase not in ("setup", "done", "zero_grad")
    ]


def phase_lines(result: TrackerResult) -> list[str]:
    unit = unit_for(result.peak_bytes)
    iteration = result.place.iteration
    lines = [f"  peak per phase of step {iteration}                   {unit[0]:>10}"]
    for phase in step_phases(result):
        nbytes = result.phase_peaks[iteration, phase]
        marker = "   <- peak" if phase == result.place.phase else ""
        lines.append(f"    {phase:<40}{_fmt(nbytes, unit):>9}{marker}")
    return lines


def module_lines(result: TrackerResult) -> list[str]:
    unit = unit_for(result.peak_bytes)
    ranked = sorted(result.modules.items(), key=lambda kv: kv[1].activations_kept, reverse=True)
    lines = [
        f"  top modules: activations left alive by their forward ({unit[0]}), "
        f"peak while running ({unit[0]})"
    ]
    for name, stats in ranked[:TOP_MODULES]:
        lines.append(
            f"    {name:<40}{_fmt(stats.activations_kept, unit):>9}{_fmt(stats.peak, unit):>12}"
        )
    return lines


def analytic_lines(traced: int, analytic: AnalyticEstimate) -> list[str]:
    diff = analytic.peak_bytes / traced - 1
    lines = [
        f"analytic estimate: {size(analytic.peak_bytes, traced)} "
        f"({diff:+.2%} vs traced; its peak: {analytic.phase})"
    ]
    if abs(diff) > ANALYTIC_WARN_FRACTION:
        lines.append(
            f"WARNING: the analytic and traced estimates differ by {diff:+.1%} "
            f"(> {ANALYTIC_WARN_FRACTION:.0%}); trust the trace, "
            "the closed form misses this layout's peak"
        )
    return lines


def additions_lines(
    allocated: int, additions: DeviceAdditions, device_memory_gib: float | None
) -> list[str]:
    lines = ["not seen by tracing (a CUDA rank adds these to the allocated peak):"]
    for label, nbytes in additions.items:
        lines.append(f"    {label:<86}{gib(nbytes):>7} GiB")
    total = allocated + additions.total
    lines.append(f"expected device memory per rank: {gib(total)} GiB")
    if device_memory_gib is not None:
        lines.append(fit_verdict(allocated, additions, device_memory_gib))
    return lines


def fit_verdict(allocated: int, additions: DeviceAdditions, device_memory_gib: float) -> str:
    capacity = device_memory_gib * GiB
    hard = allocated + CUBLAS_WORKSPACE_BYTES + CUDA_CONTEXT_BYTES
    total = allocated + additions.total
    if hard > capacity:
        return (
            f"verdict: does NOT fit in {device_memory_gib:g} GiB "
            f"(allocations alone need {gib(hard)} GiB)"
        )
    if total > capacity:
        return (
            f"verdict: tight in {device_memory_gib:g} GiB: the allocations fit, the allowances for "
            f"fragmentation and NCCL do not ({gib(total)} GiB); expect OOMs without "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or a smaller batch"
        )
    return f"verdict: fits in {device_memory_gib:g} GiB with {gib(capacity - total)} GiB to spare"
