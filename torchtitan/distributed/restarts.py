"""Automatic restart (``MAX_RESTARTS`` in run_train.sh): torchrun restarts every rank after a
failure and the restarted attempt resumes from the newest complete checkpoint. This module
holds what the ranks do about it: the injected fault of ``debug.fail_at_step``, the record of
a failure and the crash-loop rule of ``checkpoint.max_failures_at_same_step``.

When torchrun may restart the ranks, the launcher (``torchtitan.distributed.launch``) names two
files: ``TORCHTITAN_FAILURE_FILE``, fresh for each launch, where a rank that fails appends one
line (a ``Failure``), and ``TORCHTITAN_TRACEBACK_FILE``, under the dump folder, where it
appends its traceback instead of printing it. The launcher then says in one line which rank
failed, at which step and why. Local ranks, unlike global ones, stay on their node across
restarts, and each node keeps its own failure file, so no shared file system is needed.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.config.entry import exit_on_user_error, peer_reported_user_error
from torchtitan.tools.step_hooks import StepHook

FAILURE_FILE_ENV = "TORCHTITAN_FAILURE_FILE"

TRACEBACK_FILE_ENV = "TORCHTITAN_TRACEBACK_FILE"

WORKER_START_ENV = "TORCHTITAN_WORKER_START"
"""Set by the launcher: how many times this node's agent has started the ranks before (0 in
the first attempt). Unlike TORCHELASTIC_RESTART_COUNT it also counts the restarts after
another node's failure, so it is the same on every node."""


class InjectedFault(RuntimeError):
    """The error ``debug.fail_at_step`` raises."""


@dataclass(frozen=True)
class Failure:
    """One rank's failure, one tab-separated line of the failure file."""

    local_rank: int
    step: int
    """The step it failed in; 0: while setting up."""
    attempt: int
    """``TORCHTITAN_WORKER_START`` of the attempt that failed."""
    rank: int
    error: str
    """``<exception type>: <first line of its message>``."""

    def to_line(self) -> str:
        fields = (self.local_rank, self.step, self.attempt, self.rank, self.error)
        return "\t".join(map(str, fields)) + "\n"

    @classmethod
    def from_line(cls, line: str) -> Failure:
        local_rank, step, attempt, rank, error = line.rstrip("\n").split("\t", 4)
        return cls(int(local_rank), int(step), int(attempt), int(rank), error)

    def same_place(self, other: Failure) -> bool:
        return (self.local_rank, self.step) == (other.local_rank, other.step)


def restart_count() -> int:
    """How many times torchrun has restarted this node's ranks (0 in the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class FaultPlant(StepHook):
    """Raise InjectedFault at the start of step ``debug.fail_at_step`` on
    ``debug.fail_on_rank``: in the first attempt only, or in every attempt with
    ``debug.fail_every_attempt``."""

    def __init__(self, debug: Any, rank: int) -> None:
        self.debug, self.rank = debug, rank

    def step_started(self, step: int) -> None:
        debug = self.debug
        if step != debug.fail_at_step or self.rank != debug.fail_on_rank:
            return
        if debug.fail_every_attempt or restart_count() == 0:
            raise InjectedFault(
                f"debug.fail_at_step: injected fault at step {step} on rank {self.rank}"
            )


class SlowStepPlant(StepHook):
    """``debug.step_sleep_seconds`` at the start of every step (runs that must outlast a
    peer's restart or a replica group's join)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def step_started(self, step: int) -> None:
        time.sleep(self.seconds)


def build_failure_plants(debug: Any, rank: int) -> list[StepHook]:
    """The debug plants of failures this config asks for (none by default)."""
    plants: list[StepHook] = []
    if debug.fail_at_step is not None:
        plants.append(FaultPlant(debug, rank))
    if debug.step_sleep_seconds:
        plants.append(SlowStepPlant(debug.step_sleep_seconds))
    return plants


def describe_error(error: BaseException) -> str:
    """``<exception type>: <first line of its message>`` (one line, no tabs)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text.replace("\t", " ")


def read_failures(failure_file: Path) -> list[Failure]:
    """Every failure recorded so far, oldest first."""
    return [Failure.from_line(line) for line in failure_file.read_text().splitlines() if line]


def record_failure(failure_file: str, failure: Failure) -> int:
    """Append ``failure``; return how often its rank has failed at its step so far."""
    with open(failure_file, "a+") as f:
        f.seek(0)
        earlier = sum(failure.same_place(Failure.from_line(line)) for line in f if line.strip())
        f.write(failure.to_line())
    return earlier + 1


def keep_traceback(traceback_file: str, failure: Failure, error: BaseException) -> None:
    """Append the traceback of ``error`` under a header naming the rank, attempt and step
    (one write, so the ranks of a node do not interleave)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    header = (
        f"==== {when}: rank {failure.rank} (local rank {failure.local_rank}), attempt "
        f"{failure.attempt + 1}, step {failure.step} ====\n"
    )
    Path(traceback_file).parent.mkdir(parents=True, exist_ok=True)
    with open(traceback_file, "a") as f:
        f.write(header + "".join(traceback.format_exception(error)) + "\n")


def _failure_of_this_rank(step: int, error: BaseException) -> Failure:
    return Failure(
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        step=step,
        attempt=int(os.environ.get(WORKER_START_ENV, "0")),
        rank=int(os.environ.get("RANK", "0")),
        error=describe_error(error),
    )


def stop_on_crash_loop(step: int, max_failures: int) -> None:
    """Called by a rank that fails at ``step``, in the ``except`` block that caught the error.

    Without restarts (no failure file named) it returns: the caller re-raises, as under plain
    torchrun. With restarts it records the failure and its traceback and ends the rank: exit 1
    for the launcher to report in one line and restart; or, once the rank has failed
    ``max_failures`` times at ``step``, as on bad input (one error line, exit 2), which the
    launcher never restarts. A failure that follows a peer's user error (a peer left in the
    middle of a collective) also returns: the caller's entry point exits quietly with code 2.
    """
    failure_file = os.environ.get(FAILURE_FILE_ENV)
    if not failure_file or peer_reported_user_error():
        return
    error = sys.exc_info()[1]
    assert error is not None, "stop_on_crash_loop is called while handling an exception"
    failure = _failure_of_this_rank(step, error)
    failures = record_failure(failure_file, failure)
    traceback_file = os.environ[TRACEBACK_FILE_ENV]
    keep_traceback(traceback_file, failure, error)
    if failures >= max_failures:
        exit_on_user_error(
            f"checkpoint.max_failures_at_same_step: the run failed {failures} times at step "
            f"{step} ({failure.error}); not restarting again (tracebacks in {traceback_file})"
        )
    sys.exit(1)
