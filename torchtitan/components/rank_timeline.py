"""Where each rank's step time goes: phase timings, stragglers and the per-rank event log.

Every rank times its steps in phases (``PHASES``) at the points the trainer and the recipe
already pass: host clocks on CPU, CUDA events for the device phases on CUDA (read at log
steps, after the step's own sync, so steps that do not log add no host sync). At each log
step the ranks all-gather their mean phase times since the last log (one small collective,
on log steps only), and metrics.jsonl gets the median time per phase, the slowest rank and
by how much it is slower than the median rank.

The slowest rank is judged on the phases without collectives (``LOCAL_PHASES``): in the
others a fast rank waits for the slow one, so the wait shows on every rank but the slow one.
A rank that stays slowest by more than ``metrics.straggler_threshold_pct`` of a step for
``metrics.straggler_log_steps`` log steps in a row is named in one warning line. Slowness
inside forward/backward is absorbed by the collectives there (FSDP, TP) and shows as every
rank's forward_backward growing; the timeline (``scripts/timeline.py``) shows where.

With ``metrics.event_log`` each rank also writes its phases to
``{dump_folder}/events/rank-R.jsonl`` (step, phase, start, duration), buffered and written
at log steps.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.tools.logging import logger
from torchtitan.tools.step_hooks import StepHook

PHASES = (
    "data",
    "forward_backward",
    "clip_grad_norm",
    "sync",
    "optimizer",
    "checkpoint",
    "validation",
)
LOCAL_PHASES = ("data", "optimizer", "checkpoint")
"""Phases without collectives under any layout: a rank's own time."""
_DEVICE_PHASES = ("forward_backward", "clip_grad_norm", "sync", "optimizer")
"""Timed with CUDA events on CUDA (the host only launches their kernels)."""
_RECIPE_PHASES = {
    "zero_grad": "optimizer",
    "reference forward": "forward_backward",
    "forward": "forward_backward",
    "loss": "forward_backward",
    "backward": "forward_backward",
    "pipeline schedule": "forward_backward",
    "clip_grad_norm": "clip_grad_norm",
    "optimizer_step": "optimizer",
}
"""The recipe's step phases (``recipe.train_step``'s observer) in this module's terms."""


@dataclass
class _Mark:
    phase: str | None
    """None: the end of the step."""
    host: float
    event: Any | None


@dataclass(frozen=True)
class PhaseEvent:
    step: int
    phase: str
    start: float
    """Seconds since the epoch."""
    duration: float


class RankTimeline(StepHook):
    """This rank's phase clock, its share of the straggler check, and its event log.

    A step hook (``step_started``, ``step_closed``); the trainer calls ``mark`` at each
    phase change (also through the recipe's observer interface: ``set_phase`` /
    ``start_microbatch``) and ``gather_metrics`` on every rank at log steps.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        event_log: Path | None,
        threshold_pct: float,
        log_steps: int,
        hosts: list[str] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.use_events = device.type == "cuda"
        self.event_log = event_log
        self.threshold_pct = threshold_pct
        self.log_steps = log_steps
        self.step = 0
        self._marks: list[_Mark] = []
        self._done: list[tuple[int, list[_Mark]]] = []
        self._step_seconds: deque[float] = deque(maxlen=50)
        self._streak: tuple[int, int] = (-1, 0)
        self._planted_base: float | None = None
        self._file = None
        self.hosts = hosts or [socket.gethostname()] * world_size
        if event_log is not None:
            event_log.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(event_log, "a")

    # ------------------------------------------------------------------ per step (hot path)
    def step_started(self, step: int) -> None:
        self.step = step
        self._marks = []

    def mark(self, phase: str | None) -> None:
        """``phase`` starts now (None: the step ends); a repeated phase continues."""
        if self._marks and self._marks[-1].phase == phase:
            return
        event = None
        if self.use_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._marks.append(_Mark(phase, time.time(), event))

    def set_phase(self, phase: str) -> None:
        self.mark(_RECIPE_PHASES.get(phase, phase))

    def start_microbatch(self, module: nn.Module | None = None) -> None:
        pass

    def step_closed(self, step: int, committed: bool) -> None:
        self.mark(None)
        marks = self._marks
        self._done.append((self.step, marks))
        self._step_seconds.append(marks[-1].host - marks[0].host)

    def median_step_seconds(self) -> float | None:
        return statistics.median(self._step_seconds) if self._step_seconds else None

    # ------------------------------------------------------------------ log steps
    def _events(self) -> tuple[list[PhaseEvent], int]:
        """The completed steps' phases since the last call, and how many steps (CUDA: device
        time for the device phases, which waits here for their last event)."""
        events, steps = [], len(self._done)
        for step, marks in self._done:
            for begin, end in zip(marks, marks[1:], strict=False):
                duration = end.host - begin.host
                if self.use_events and begin.phase in _DEVICE_PHASES:
                    end.event.synchronize()
                    duration = begin.event.elapsed_time(end.event) / 1000
                events.append(PhaseEvent(step, begin.phase, begin.host, duration))
        self._done = []
        self._write(events)
        return events, steps

    def _write(self, events: list[PhaseEvent]) -> None:
        if self._file is not None:
            self._file.writelines(
                f'{{"step": {e.step}, "phase": "{e.phase}", "start": {e.start!r}, '
                f'"duration": {e.duration!r}}}\n'
                for e in events
            )
            self._file.flush()

    def gather_metrics(self) -> dict[str, float]:
        """On every rank at a log step: the phase times of all ranks since the last log,
        their metrics, and the straggler warning when due."""
        events, steps = self._events()
        totals = dict.fromkeys(PHASES, 0.0)
        for e in events:
            totals[e.phase] += e.duration
        local = torch.tensor([*totals.values(), steps], dtype=torch.float64)
        table = self._all_gather(local)
        if table[:, -1].min() == 0:
            return {}  # no completed step since the last log (step 1)
        per_step = table[:, :-1] / table[:, -1:]
        return self._judge(per_step.tolist())

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return local.unsqueeze(0)
        device = self.device if self.device.type != "cpu" else torch.device("cpu")
        out = torch.empty(self.world_size * local.numel(), dtype=local.dtype, device=device)
        dist.all_gather_into_tensor(out, local.to(device))
        return out.cpu().view(self.world_size, -1)

    def _judge(self, per_step: list[list[float]]) -> dict[str, float]:
        medians = {p: statistics.median(row[i] for row in per_step) for i, p in enumerate(PHASES)}
        step_time = sum(medians.values())
        local = [sum(row[PHASES.index(p)] for p in LOCAL_PHASES) for row in per_step]
        slowest = max(range(len(local)), key=local.__getitem__)
        excess = local[slowest] - statistics.median(local)
        excess_pct = 100 * excess / step_time if step_time > 0 else 0.0
        self._warn_if_persistent(slowest, excess_pct, per_step[slowest], medians)
        return {
            **{f"phase_time/{p}": t for p, t in medians.items()},
            "slowest_rank": slowest,
            "slowest_rank_excess_pct": excess_pct,
        }

    def _warn_if_persistent(
        self, rank: int, excess_pct: float, times: list[float], medians: dict[str, float]
    ) -> None:
        if excess_pct <= self.threshold_pct:
            self._streak = (-1, 0)
            return
        previous, count = self._streak
        count = count + 1 if previous == rank else 1
        self._streak = (rank, count)
        if count != self.log_steps:
            return
        phase = max(LOCAL_PHASES, key=lambda p: times[PHASES.index(p)] - medians[p])
        logger.warning(
            f"straggler: rank {rank} ({self.hosts[rank]}) has been the slowest rank for "
            f"{count} log steps, "
            f"{excess_pct:.0f}% of a step slower than the median rank, in {phase} "
            f"({times[PHASES.index(phase)]:.3f} s per step, median rank {medians[phase]:.3f} s)"
        )

    def planted_delay(self, debug: Any) -> float:
        """``debug.straggler_rank``: from ``debug.straggler_from_step`` that rank waits
        ``debug.straggler_slowdown`` x its median step before then, in its data phase."""
        if self.rank != debug.straggler_rank or self.step < debug.straggler_from_step:
            return 0.0
        if self._planted_base is None:
            self._planted_base = self.median_step_seconds() or 0.0
        return debug.straggler_slowdown * self._planted_base

    def close(self) -> None:
        self._events()  # the steps after the last log step
        if self._file is not None:
            self._file.close()
            self._file = None


def build_rank_timeline(metrics: Any, dump_folder: str, device: torch.device) -> RankTimeline:
    """This rank's timeline; the ranks exchange their host names (once, for the warning)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    hosts = [socket.gethostname()] * world_size
    if world_size > 1:
        dist.all_gather_object(hosts, socket.gethostname())
    return RankTimeline(
        rank=rank,
        world_size=world_size,
        hosts=hosts,
        device=device,
        event_log=Path(dump_folder) / "events" / f"rank-{rank}.jsonl"
        if metrics.event_log
        else None,
        threshold_pct=metrics.straggler_threshold_pct,
        log_steps=metrics.straggler_log_steps,
    )


class StragglerPlant(StepHook):
    """``debug.straggler_rank`` waits its planted delay at the start of each step, in the data
    phase of ``timeline`` (a hook after it)."""

    def __init__(self, timeline: RankTimeline, debug: Any) -> None:
        self.timeline, self.debug = timeline, debug

    def step_started(self, step: int) -> None:
        delay = self.timeline.planted_delay(self.debug)
        if delay:
            self.timeline.mark("data")
            time.sleep(delay)


def build_straggler_plant(timeline: RankTimeline, debug: Any) -> StragglerPlant | None:
    return StragglerPlant(timeline, debug) if debug.straggler_rank is not None else None
