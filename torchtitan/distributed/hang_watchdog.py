"""Hang detection: a daemon thread per rank watches the training step.

When a step has run longer than ``comm.hang_timeout_factor`` times the median step (and at
least ``comm.hang_timeout_floor_seconds``), every rank writes the Python stacks of all its
threads to ``{dump_folder}/hangs/step-N/rank-R.txt`` (and, beside it, torch's flight recorder
of its recent collectives where torch offers it) and posts where its main thread is to the
job's c10d store, which answers from any thread while the main threads are stuck. Rank 0 then
groups the ranks by that place: the largest group waits in a collective, and the line it logs
names the ranks that are elsewhere and the file:line they are at. ``comm.on_hang`` says what
follows: keep waiting (the collective timeout still applies) or exit with status 124 on every
rank, so that automatic restart takes over.

Written by hand: torch's watchdogs (NCCL's heartbeat, the flight recorder's dump on timeout)
act on single collectives; none compares a step with the run's own step times or names the
ranks that never reached the collective the others wait in.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.distributed.restarts import (
    FAILURE_FILE_ENV,
    TRACEBACK_FILE_ENV,
    WORKER_START_ENV,
    Failure,
    record_failure,
)
from torchtitan.tools.logging import logger
from torchtitan.tools.step_hooks import StepHook

HANG_EXIT_CODE = 124
"""Status of every rank after a hang under ``comm.on_hang = "exit"`` (as timeout(1))."""

_RECENT_STEPS = 50
_COLLECT_SECONDS = 10.0
"""How long rank 0 waits for the other ranks' reports, and they for its summary."""


@dataclass(frozen=True)
class HangReport:
    """Where one rank's main thread is while its step hangs."""

    rank: int
    host: str
    where: str
    """The innermost frame: ``file:line in function``."""
    caller: str
    """The innermost frame in torchtitan's own code (what called into torch), or ``where``."""


def short_path(filename: str) -> str:
    """``torchtitan/...`` or the path below ``site-packages/``; others unchanged."""
    for marker in ("site-packages/", "/torchtitan/", "/tests/", "/scripts/"):
        index = filename.rfind(marker)
        if index >= 0:
            return filename[index + (len(marker) if marker == "site-packages/" else 1) :]
    return filename


def _frame_text(frame: traceback.FrameSummary) -> str:
    return f"{short_path(frame.filename)}:{frame.lineno} in {frame.name}"


def main_thread_report(rank: int) -> HangReport:
    """Where the main thread of this process is now."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = traceback.extract_stack(frame) if frame is not None else []
    if not stack:
        return HangReport(rank, socket.gethostname(), "unknown", "unknown")
    ours = [f for f in stack if "/torchtitan/" in f.filename and "hang_watchdog" not in f.filename]
    where = _frame_text(stack[-1])
    return HangReport(rank, socket.gethostname(), where, _frame_text(ours[-1]) if ours else where)


def format_all_stacks() -> str:
    """Every thread's Python stack, the main thread first, each under its thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    parts = []
    for ident, frame in frames:
        header = f"Thread {names.get(ident, '?')} ({ident}), most recent call last:\n"
        parts.append(header + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, sorted(ranks)))


def summarize_hang(
    step: int,
    elapsed: float,
    threshold: float,
    reports: dict[int, HangReport],
    world_size: int,
    folder: Path,
) -> str:
    """One line: the ranks that wait together (the largest group by place; a place inside
    torch.distributed wins a tie) and every rank that is elsewhere or sent no report."""
    by_place = Counter(r.where for r in reports.values())
    waiting_place = max(by_place, key=lambda p: (by_place[p], "torch/distributed" in p))
    waiting = [r for r in reports.values() if r.where == waiting_place]
    caller = waiting[0].caller
    text = (
        f"hang: step {step} has run {elapsed:.1f} s (threshold {threshold:.1f} s); "
        f"{_ranks_text([r.rank for r in waiting])} wait at {waiting_place}"
        + (f" (from {caller})" if caller != waiting_place else "")
    )
    others = sorted((r for r in reports.values() if r.where != waiting_place), key=lambda r: r.rank)
    if others:
        text += "; not there: " + "; ".join(
            f"rank {r.rank} ({r.host}) at {r.where}"
            + (f" (from {r.caller})" if r.caller != r.where else "")
            for r in others
        )
    missing = sorted(set(range(world_size)) - set(reports))
    if missing:
        text += f"; no report from {_ranks_text(missing)} (stuck outside Python, or gone)"
    if not others and not missing and world_size > 1:
        text += (
            "; every rank is there: the collective itself is stuck (network, or a peer's device)"
        )
    return text + f"; stacks in {folder}"


class HangWatchdog(StepHook):
    """Watches this rank's training steps from a daemon thread (see the module docstring).

    A step hook: ``step_started`` / ``step_finished`` bracket each step (validation and
    checkpointing are not watched): two attribute writes, nothing on the device. ``store``
    is the job's c10d store (None in one process).
    """

    def __init__(
        self,
        *,
        factor: float,
        floor_seconds: float,
        policy: str,
        dump_folder: str,
        rank: int,
        world_size: int,
        store: Any | None,
        attempt: int = 0,
        device_type: str = "cpu",
        exit_process: Callable[[int], None] = os._exit,
    ) -> None:
        self.factor = factor
        self.floor_seconds = floor_seconds
        self.policy = policy
        self.dump_folder = Path(dump_folder)
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.attempt = attempt
        self.device_type = device_type
        self.exit_process = exit_process
        self.durations: deque[float] = deque(maxlen=_RECENT_STEPS)
        self.reported_steps: list[int] = []
        self._running: tuple[int, float] | None = None
        self._closed = threading.Event()
        self._poll = min(1.0, floor_seconds / 4)
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def step_started(self, step: int) -> None:
        self._running = (step, time.monotonic())

    def step_finished(self, step: int) -> None:
        running, self._running = self._running, None
        if running is not None:
            self.durations.append(time.monotonic() - running[1])

    def threshold(self) -> float | None:
        """Seconds after which the running step is a hang; None before a step has finished."""
        if not self.durations:
            return None
        return max(self.floor_seconds, self.factor * statistics.median(self.durations))

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._closed.wait(self._poll):
            running, threshold = self._running, self.threshold()
            if running is None or threshold is None:
                continue
            step, start = running
            elapsed = time.monotonic() - start
            if elapsed > threshold and step not in self.reported_steps:
                self.reported_steps.append(step)
                self._report(step, elapsed, threshold)

    def _report(self, step: int, elapsed: float, threshold: float) -> None:
        folder = self.dump_folder / "hangs" / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        report = main_thread_report(self.rank)
        (folder / f"rank-{self.rank}.txt").write_text(
            f"rank {self.rank} ({report.host}), step {step}, running {elapsed:.1f} s "
            f"(threshold {threshold:.1f} s)\n\n{format_all_stacks()}"
        )
        self._dump_flight_recorder(folder)
        prefix = f"torchtitan/hang/{self.attempt}/{step}/"
        if self.store is not None:
            self.store.set(prefix + f"rank/{self.rank}", json.dumps(asdict(report)))
        if self.rank == 0:
            reports = self._collect(prefix) if self.store is not None else {0: report}
            summary = summarize_hang(step, elapsed, threshold, reports, self.world_size, folder)
            logger.error(summary)
            if self.policy == "exit":
                record_hang_for_launcher(step, self.attempt, summary)
            if self.store is not None:
                self.store.set(prefix + "summarized", "1")
        if self.policy == "exit":
            self._exit(step, prefix)

    def _collect(self, prefix: str) -> dict[int, HangReport]:
        keys = {rank: prefix + f"rank/{rank}" for rank in range(self.world_size)}
        self._wait_for(list(keys.values()), _COLLECT_SECONDS)
        return {
            rank: HangReport(**json.loads(self.store.get(key)))
            for rank, key in keys.items()
            if self.store.check([key])
        }

    def _exit(self, step: int, prefix: str) -> None:
        """The other ranks leave once rank 0 has logged its summary (the launcher ends the
        ranks still running when the first one exits)."""
        if self.rank != 0 and self.store is not None:
            self._wait_for([prefix + "summarized"], 2 * _COLLECT_SECONDS)
        if self.rank == 0:
            logger.error(
                f"comm.on_hang = exit: every rank exits with status {HANG_EXIT_CODE} "
                "(automatic restart, MAX_RESTARTS, resumes from the last checkpoint)"
            )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit_process(HANG_EXIT_CODE)

    def _wait_for(self, keys: list[str], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.2)

    def _dump_flight_recorder(self, folder: Path) -> None:
        """torch's flight recorder of this rank's recent collectives (comm.trace_buf_size
        entries; gloo and NCCL on torch >= 2.7, NCCL only before), as torch writes it: read it
        with ``python -m torch.distributed.flight_recorder.fr_trace``."""
        c10d = torch._C._distributed_c10d
        dump = getattr(c10d, "_dump_fr_trace", None)
        if dump is None and self.device_type == "cuda":
            dump = getattr(c10d, "_dump_nccl_trace", None)
        if dump is None or os.environ.get("TORCH_FR_BUFFER_SIZE", "0") == "0":
            return
        try:
            (folder / f"rank-{self.rank}.flight_recorder").write_bytes(dump())
        except RuntimeError as e:
            logger.warning(f"hang: no flight recorder dump ({e})")


def record_hang_for_launcher(step: int, attempt: int, summary: str) -> None:
    """Under the launcher's automatic restart: the hang as this attempt's failure record (its
    restart line names it) and the summary in the traceback file (where it sends readers)."""
    failure_file = os.environ.get(FAILURE_FILE_ENV)
    if not failure_file:
        return
    error = "Hang: " + summary.removeprefix("hang: ").split("; stacks in ")[0]
    failure = Failure(int(os.environ.get("LOCAL_RANK", "0")), step, attempt, 0, error)
    record_failure(failure_file, failure)
    traceback_file = Path(os.environ[TRACEBACK_FILE_ENV])
    traceback_file.parent.mkdir(parents=True, exist_ok=True)
    with open(traceback_file, "a") as f:
        f.write(f"==== attempt {attempt + 1}, step {step}: {summary} ====\n\n")


def build_hang_watchdog(comm: Any, dump_folder: str, device_type: str) -> HangWatchdog | None:
    """The watchdog of ``comm`` (None with ``comm.hang_timeout_factor = 0``)."""
    if comm.hang_timeout_factor == 0:
        return None
    distributed = dist.is_initialized()
    return HangWatchdog(
        factor=comm.hang_timeout_factor,
        floor_seconds=comm.hang_timeout_floor_seconds,
        policy=comm.on_hang,
        dump_folder=dump_folder,
        rank=dist.get_rank() if distributed else 0,
        world_size=dist.get_world_size() if distributed else 1,
        store=dist.distributed_c10d._get_default_store() if distributed else None,
        attempt=int(os.environ.get(WORKER_START_ENV, "0")),
        device_type=device_type,
    )


class HangPlant(StepHook):
    """``debug.hang_at_step``: rank ``debug.hang_on_rank`` sleeps before the step's flag
    all-reduce, while the other ranks wait in it (tests of the watchdog)."""

    def __init__(self, debug: Any, rank: int) -> None:
        self.debug, self.rank = debug, rank

    def before_sync(self, step: int) -> None:
        maybe_plant_hang(self.debug, step, self.rank)


def maybe_plant_hang(debug: Any, step: int, rank: int) -> None:
    if step == debug.hang_at_step and rank == debug.hang_on_rank:
        time.sleep(debug.hang_seconds)


def build_hang_plant(debug: Any, rank: int) -> HangPlant | None:
    return HangPlant(debug, rank) if debug.hang_at_step is not None else None
