"""Automatic restart (``MAX_RESTARTS`` in run_train.sh): torchrun restarts every rank after a
failure and the restarted attempt resumes from the newest complete checkpoint. This module
holds what the ranks do about it: the injected fault of ``debug.fail_at_step`` and the
crash-loop rule of ``checkpoint.max_failures_at_same_step``.

The launcher (``torchtitan.distributed.launch``) names a file, fresh for each launch, in
``TORCHTITAN_FAILURE_FILE``; a rank that fails appends ``<local rank><TAB><step>`` to it.
Local ranks, unlike global ones, stay on their node across restarts, and each node keeps its
own file, so no shared file system is needed.
"""

from __future__ import annotations

import os

from torchtitan.config.entry import exit_on_user_error

FAILURE_FILE_ENV = "TORCHTITAN_FAILURE_FILE"

WORKER_START_ENV = "TORCHTITAN_WORKER_START"
"""Set by the launcher: how many times this node's agent has started the ranks before (0 in
the first attempt). Unlike TORCHELASTIC_RESTART_COUNT it also counts the restarts after
another node's failure, so it is the same on every node."""


class InjectedFault(RuntimeError):
    """The error ``debug.fail_at_step`` raises."""


def restart_count() -> int:
    """How many times torchrun has restarted this node's ranks (0 in the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def maybe_inject_fault(debug, step: int, rank: int) -> None:
    """Raise InjectedFault at ``debug.fail_at_step`` on ``debug.fail_on_rank``: in the first
    attempt only, or in every attempt with ``debug.fail_every_attempt``."""
    if step != debug.fail_at_step or rank != debug.fail_on_rank:
        return
    if debug.fail_every_attempt or restart_count() == 0:
        raise InjectedFault(f"debug.fail_at_step: injected fault at step {step} on rank {rank}")


def record_failure(failure_file: str, local_rank: int, step: int) -> int:
    """Append this rank's failure at ``step``; return how often it has failed there so far."""
    entry = f"{local_rank}\t{step}\n"
    with open(failure_file, "a+") as f:
        f.seek(0)
        earlier = sum(line == entry for line in f)
        f.write(entry)
    return earlier + 1


def stop_on_crash_loop(step: int, max_failures: int) -> None:
    """Called by a rank that fails at ``step``: record it and, once the rank has failed
    ``max_failures`` times there, stop as on bad input (one error line, exit 2), which the
    launcher never restarts. Without the launcher (plain torchrun) nothing is counted."""
    failure_file = os.environ.get(FAILURE_FILE_ENV)
    if not failure_file:
        return
    failures = record_failure(failure_file, int(os.environ.get("LOCAL_RANK", "0")), step)
    if failures >= max_failures:
        exit_on_user_error(
            f"checkpoint.max_failures_at_same_step: the run failed {failures} times at step "
            f"{step}, resuming from the newest checkpoint each time; not restarting again "
            "(the tracebacks above show the cause)"
        )
