"""``--memory_estimation.plot mem.png``: the traced step's memory per phase as a stacked bar
chart, one bar per phase, stacked by the report's categories, the peak marked. matplotlib (the
``plot`` extra) is imported only here, on the Agg canvas."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan.config import ConfigError
from torchtitan.estimate import report
from torchtitan.estimate.memory_tracker import TrackerResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MATPLOTLIB_HINT = "--memory_estimation.plot needs matplotlib: pip install -e '.[plot]'"


def require_matplotlib() -> None:
    """Fail before tracing when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(MATPLOTLIB_HINT) from None


def phase_stacks(result: TrackerResult) -> tuple[list[str], dict[str, list[int]]]:
    """The phases of the peak's step and, per report heading, its bytes at each phase's peak."""
    phases = report.step_phases(result)
    iteration = result.place.iteration
    totals = [report.heading_totals(result.phase_breakdowns[iteration, p]) for p in phases]
    headings = report.heading_totals({})  # every heading, in report order
    return phases, {h: [t[h] for t in totals] for h in headings}


def plot_breakdown(result: TrackerResult, title: str) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    phases, stacks = phase_stacks(result)
    unit_name, unit = report.unit_for(result.peak_bytes)
    figure = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    positions = range(len(phases))
    tops = [0.0] * len(phases)
    for color, (heading, nbytes) in enumerate(stacks.items()):
        heights = [n / unit for n in nbytes]
        # each heading keeps its colour; the empty ones stay out of the legend
        label = heading if any(nbytes) else f"_{heading}"
        ax.bar(positions, heights, bottom=tops, label=label, color=f"C{color}")
        tops = [t + h for t, h in zip(tops, heights)]
    for x, top in zip(positions, tops):
        ax.annotate(f"{top:.1f}", (x, top), xytext=(0, 2), textcoords="offset points", ha="center")
    _mark_peak(ax, phases, result, unit_name, unit)
    ax.set_ylabel(f"allocated per rank ({unit_name})")
    ax.set_xlabel(f"phase of step {result.place.iteration}")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return figure


def _mark_peak(
    ax: Axes, phases: list[str], result: TrackerResult, unit_name: str, unit: int
) -> None:
    """A dashed line at the traced peak; the peak phase's name in bold."""
    peak = result.peak_bytes / unit
    ax.axhline(peak, color="black", linestyle="--", linewidth=1)
    ax.annotate(
        f"traced peak {peak:.2f} {unit_name}",
        (0, peak),
        xycoords=("axes fraction", "data"),
        xytext=(4, 3),
        textcoords="offset points",
        fontsize="small",
    )
    ax.set_ylim(top=peak * 1.18)
    labels = [f"{p}\n(peak)" if p == result.place.phase else p for p in phases]
    ax.set_xticks(range(len(phases)), labels)
    for phase, label in zip(phases, ax.get_xticklabels()):
        if phase == result.place.phase:
            label.set_fontweight("bold")


def save_breakdown_plot(result: TrackerResult, title: str, path: str) -> None:
    try:
        plot_breakdown(result, title).savefig(Path(path), dpi=120)
    except OSError as e:
        raise ConfigError(f"memory_estimation.plot: cannot write {path} ({e.strerror})") from None
