"""Draw the per-rank event log (``metrics.event_log``) as a timeline: one lane per rank, one
colour per phase, so a straggler is seen rather than read.

    python scripts/timeline.py OUTPUT_FOLDER/events [--steps 5:12] [--out timeline]

writes ``timeline.html`` (self-contained: inline SVG, a tooltip per bar) and, when matplotlib
is installed (``pip install 'torchtitan[plot]'``), ``timeline.png``; it prints each rank's
mean time per phase, the rank that is slowest in a phase marked.
"""

from __future__ import annotations

import argparse
import html
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

PHASE_COLOURS = {
    "data": "#d62728",
    "forward_backward": "#1f77b4",
    "clip_grad_norm": "#9467bd",
    "sync": "#c7c7c7",
    "optimizer": "#2ca02c",
    "checkpoint": "#ff7f0e",
    "validation": "#17becf",
}
LANE_HEIGHT = 28
WIDTH = 1200
LEFT = 70


def read_events(folder: Path, steps: range | None) -> dict[int, list[dict]]:
    """Each rank's events (``rank-R.jsonl``), within ``steps`` when given."""
    lanes = {}
    for path in sorted(folder.glob("rank-*.jsonl")):
        rank = int(path.stem.removeprefix("rank-"))
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        lanes[rank] = [e for e in events if steps is None or e["step"] in steps]
    return dict(sorted(lanes.items()))


def phase_means(lanes: dict[int, list[dict]]) -> dict[int, dict[str, float]]:
    """Seconds per step in each phase, per rank."""
    means = {}
    for rank, events in lanes.items():
        totals: dict[str, float] = defaultdict(float)
        for e in events:
            totals[e["phase"]] += e["duration"]
        steps = max(len({e["step"] for e in events}), 1)
        means[rank] = {phase: totals[phase] / steps for phase in PHASE_COLOURS}
    return means


def summary_lines(means: dict[int, dict[str, float]]) -> list[str]:
    """One line per rank; ``*`` marks the slowest rank of a phase when it is more than 10 %
    of that rank's step above the median rank."""
    medians = {p: statistics.median(m[p] for m in means.values()) for p in PHASE_COLOURS}
    lines = []
    for rank, m in means.items():
        step = sum(m.values()) or 1.0
        cells = []
        for phase, seconds in m.items():
            slowest = max(means, key=lambda r: means[r][phase]) == rank
            mark = "*" if slowest and seconds - medians[phase] > 0.1 * step else " "
            cells.append(f"{phase} {seconds:7.3f}{mark}")
        lines.append(f"rank {rank:>3}: " + "  ".join(cells))
    return lines


def _bars(lanes: dict[int, list[dict]]) -> tuple[float, float, list[tuple[int, dict]]]:
    starts = [e["start"] for events in lanes.values() for e in events]
    ends = [e["start"] + e["duration"] for events in lanes.values() for e in events]
    origin, span = min(starts), max(ends) - min(starts)
    bars = [(rank, e) for rank, events in lanes.items() for e in events]
    return origin, max(span, 1e-9), bars


def write_html(lanes: dict[int, list[dict]], path: Path, summary: list[str]) -> None:
    origin, span, bars = _bars(lanes)
    scale = (WIDTH - LEFT) / span
    height = LANE_HEIGHT * len(lanes) + 40
    rows = [
        f'<text x="4" y="{i * LANE_HEIGHT + 18}">rank {rank}</text>' for i, rank in enumerate(lanes)
    ]
    lane_of = {rank: i for i, rank in enumerate(lanes)}
    for rank, e in bars:
        x = LEFT + (e["start"] - origin) * scale
        tip = html.escape(
            f"rank {rank}, step {e['step']}: {e['phase']} {e['duration'] * 1e3:.1f} ms"
        )
        colour = PHASE_COLOURS.get(e["phase"], "#000")
        rows.append(
            f'<rect x="{x:.2f}" y="{lane_of[rank] * LANE_HEIGHT + 4}" '
            f'width="{max(e["duration"] * scale, 0.5):.2f}" height="{LANE_HEIGHT - 8}" '
            f'fill="{colour}"><title>{tip}</title></rect>'
        )
    rows.append(
        f'<text x="{LEFT}" y="{height - 8}">0 s</text>'
        f'<text x="{WIDTH - 60}" y="{height - 8}">{span:.2f} s</text>'
    )
    legend = " ".join(
        f'<span style="background:{c};padding:0 8px">&nbsp;</span> {p}'
        for p, c in PHASE_COLOURS.items()
    )
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>torchtitan timeline</title>"
        "</head><body style='font-family:sans-serif'>"
        f"<h3>Per-rank timeline ({len(lanes)} ranks)</h3><p>{legend}</p>"
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-size="12">{"".join(rows)}</svg>'
        f"<pre>{html.escape(chr(10).join(summary))}</pre></body></html>\n"
    )


def write_png(lanes: dict[int, list[dict]], path: Path) -> bool:
    """False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    origin, span, _ = _bars(lanes)
    fig, ax = plt.subplots(figsize=(14, 0.5 * len(lanes) + 1.5))
    for i, events in enumerate(lanes.values()):
        for phase, colour in PHASE_COLOURS.items():
            spans = [(e["start"] - origin, e["duration"]) for e in events if e["phase"] == phase]
            ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=colour)
    ax.set_yticks(range(len(lanes)), [f"rank {r}" for r in lanes])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("seconds")
    ax.legend(
        handles=[Patch(color=c, label=p) for p, c in PHASE_COLOURS.items()],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25),
        ncol=len(PHASE_COLOURS),
        fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _steps(text: str | None) -> range | None:
    if text is None:
        return None
    first, _, last = text.partition(":")
    return range(int(first), int(last) + 1 if last else int(first) + 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("events", type=Path, help="the run's events folder")
    parser.add_argument("--steps", help="first:last step to draw (default: all)")
    parser.add_argument("--out", type=Path, default=Path("timeline"), help="output path prefix")
    args = parser.parse_args(argv)
    try:
        steps = _steps(args.steps)
    except ValueError:
        print(f"error: --steps: expected first:last, got {args.steps!r}", file=sys.stderr)
        return 2
    lanes = read_events(args.events, steps)
    if not any(lanes.values()):
        print(
            f"error: no events in {args.events} (run with --metrics.event_log; --steps in range?)",
            file=sys.stderr,
        )
        return 2
    summary = summary_lines(phase_means(lanes))
    print("seconds per step (* slowest rank of a phase, by more than 10 % of a step):")
    print("\n".join(summary))
    html_path = args.out.with_suffix(".html")
    write_html(lanes, html_path, summary)
    print(f"wrote {html_path}")
    png_path = args.out.with_suffix(".png")
    if write_png(lanes, png_path):
        print(f"wrote {png_path}")
    else:
        print("no PNG: matplotlib is not installed (pip install 'torchtitan[plot]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
