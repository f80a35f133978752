"""The closed form's answer: the per-rank peak of the most loaded pipeline stage, its phase
and what it holds, or why the closed form does not cover a run."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.estimate.closed_form.inputs import Layout, Run
from torchtitan.estimate.closed_form.phases import BASE_LOAD, stage_phases
from torchtitan.estimate.closed_form.stage import stage_sizes
from torchtitan.protocols.geometry import Geometry


@dataclass
class AnalyticEstimate:
    peak_bytes: int
    phase: str
    phases: dict[str, int]
    items: dict[str, int]


def training_peak(estimate: AnalyticEstimate) -> tuple[int, str]:
    """(bytes, phase) of the largest phase of the training step itself."""
    phase = max((p for p in estimate.phases if p != BASE_LOAD), key=estimate.phases.get)
    return estimate.phases[phase], phase


def not_covered(g: Geometry, lay: Layout, run: Run) -> str | None:
    """Why the closed form does not cover this model on this layout and run, or None."""
    if run.float8:
        return "float8 linears (their casts and scales; the trace covers them)"
    if lay.ac == "selective:op":
        return "op-level selective activation checkpointing"
    if lay.ac == "memory_budget":
        return "memory-budget activation checkpointing (the compiler's choice of what to keep)"
    if g.delta_rule is not None and lay.cp > 1:
        # context parallel over the delta rule (distributed/context_parallel/delta_rule.py)
        # keeps only the rule's inputs and received states and recomputes each chunk in
        # backward: not what this model counts
        return "context parallel over Gated DeltaNet layers"
    return None


def estimate_peak(g: Geometry, lay: Layout, run: Run) -> AnalyticEstimate | None:
    """The per-rank peak of the most loaded pipeline stage (None where :func:`not_covered`
    says why: op-level selective or memory-budget AC, context parallel over Gated DeltaNet
    layers, float8)."""
    if not_covered(g, lay, run) is not None:
        return None
    stages = [
        _stage_estimate(g, lay, run, first=(s == 0), last=(s == lay.pp - 1)) for s in range(lay.pp)
    ]
    return max(stages, key=lambda e: e.peak_bytes)


def _stage_estimate(
    g: Geometry, lay: Layout, run: Run, first: bool, last: bool
) -> AnalyticEstimate:
    phases, items = stage_phases(stage_sizes(g, lay, run, first, last), g, lay, run, first, last)
    phase = max(phases, key=phases.get)
    return AnalyticEstimate(
        int(phases[phase]),
        phase,
        {k: int(v) for k, v in phases.items()},
        {k: int(v) for k, v in items.items()},
    )
