"""``python -m torchtitan.distributed.launch [torchrun options] -m module args``: torchrun
(``torch.distributed.run``, in this process, so signals reach it as before) with two additions.

A rank that stops on bad input (a config value, a checkpoint that does not load, ...) records
``<rank><TAB><message>`` in the file named by ``TORCHTITAN_USER_ERROR_FILE`` and exits 2.
When the run ends that way (every failed worker exited 2, or was stopped by torchrun after
a peer did), this launcher prints the lowest such rank's message as one ``error:`` line and
exits 2, without torchrun's crash report and traceback; the one-process config check does
the same. Any other failure ends exactly as under torchrun, except for the trainer's below.

With ``--max-restarts N`` (run_train.sh's ``MAX_RESTARTS``) torchrun restarts the ranks after
a failure, but never after a user error: bad input fails the same way again, and a crash
loop (``torchtitan.distributed.restarts``) is reported as one. For ``-m torchtitan.train`` a
rank that fails records the failure (a line of the failure file, fresh for each launch) and
appends its traceback to ``{job.dump_folder}/tracebacks.log`` (``tracebacks.<host>.log`` on
several nodes) instead of printing it; before each restart this launcher prints one line::

    restart 1 of 2: rank 0 failed at step 3 (InjectedFault: ...); resuming from the newest
    complete checkpoint (step 2); tracebacks in outputs/tracebacks.log

and, once no restart is left, one ``error:`` line of the same kind (exit 1).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
    record,
)
from torch.distributed.run import parse_args, parse_min_max_nnodes, run

from torchtitan.config import ConfigManager, JobConfig
from torchtitan.config.entry import USER_ERROR_EXIT_CODE, USER_ERROR_FILE_ENV
from torchtitan.config.errors import UserInputError
from torchtitan.distributed.fault_tolerance import replica_dump_folder
from torchtitan.distributed.restarts import (
    FAILURE_FILE_ENV,
    TRACEBACK_FILE_ENV,
    WORKER_START_ENV,
    Failure,
    read_failures,
)
from torchtitan.tools.storage import checkpoint_root

_WORKER_MONITOR_LOGGER = "torch.distributed.elastic.multiprocessing.api"
TRAINER_MODULE = "torchtitan.train"
CHECKPOINT_MANIFEST = (
    "checkpoint.json"  # torchtitan.components.checkpointing.safe_loading.MANIFEST_FILE
)


def lowest_rank_error(report_file: Path) -> str | None:
    """The message of the lowest rank that recorded a user error, or None."""
    errors = {}
    for line in report_file.read_text().splitlines():
        rank, _, message = line.partition("\t")
        errors.setdefault(int(rank), message)
    return errors[min(errors)] if errors else None


def ended_on_user_error(failure: ChildFailedError, report_file: Path) -> bool:
    """Every failed worker exited with the user-error code or was killed by a signal
    (torchrun stops the other workers once one fails), and some rank recorded its error."""
    codes = [f.exitcode for f in failure.failures.values()]
    stopped_by_user_error = all(c == USER_ERROR_EXIT_CODE or c < 0 for c in codes)
    return (
        USER_ERROR_EXIT_CODE in codes and stopped_by_user_error and report_file.stat().st_size > 0
    )


def newest_full_checkpoint(root: Path) -> int | None:
    """The step of the newest complete full checkpoint under ``root`` (what a restarted
    attempt resumes from, unless its files turn out to be corrupt), or None. Reads the layout
    of ``torchtitan.components.checkpointing``, a layer above this one: ``step-N`` folders,
    each complete once its manifest (written last) exists, which says whether it is model-only."""
    steps = []
    for manifest in root.glob(f"step-*/{CHECKPOINT_MANIFEST}"):
        step = manifest.parent.name.removeprefix("step-")
        try:
            full = not json.loads(manifest.read_text())["model_only"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if step.isdigit() and full:
            steps.append(int(step))
    return max(steps, default=None)


def _current_attempt() -> int:
    return int(os.environ.get(WORKER_START_ENV, "0"))


def _exit_text(process: ProcessFailure) -> str:
    if process.exitcode < 0:
        return f"was killed by {process.signal_name()}"
    return f"exited with code {process.exitcode}"


@dataclass(frozen=True)
class RestartReport:
    """The trainer's failure records, and what the launcher says about them in one line."""

    failure_file: Path
    traceback_file: Path
    checkpoint_root: Path | None
    """None: checkpoint.enable is off."""
    max_restarts: int

    def recorded_failure(self) -> Failure | None:
        """The first failure a rank recorded in the current attempt (the others followed)."""
        attempt = _current_attempt()
        return next((f for f in read_failures(self.failure_file) if f.attempt == attempt), None)

    def cause(self, failures: dict[int, ProcessFailure]) -> str:
        """Which rank failed and why: its record, else torchrun's first observed failure."""
        failure = self.recorded_failure()
        if failure is None:
            rank, process = min(failures.items(), key=lambda item: item[1].timestamp)
            return f"rank {rank} {_exit_text(process)}"
        where = f"at step {failure.step}" if failure.step else "while setting up"
        return f"rank {failure.rank} failed {where} ({failure.error})"

    def traceback_note(self) -> str:
        """Where the tracebacks are, when a rank recorded its failure."""
        if self.recorded_failure() is None:
            return ""
        return f"; tracebacks in {self.traceback_file}"

    def resume_text(self) -> str:
        if self.checkpoint_root is None:
            return "starting again from step 1 (checkpoint.enable is off)"
        step = newest_full_checkpoint(self.checkpoint_root)
        if step is None:
            return "starting again from step 1 (no complete checkpoint yet)"
        return f"resuming from the newest complete checkpoint (step {step})"

    def restart_line(self, restart: int, failures: dict[int, ProcessFailure]) -> str:
        return (
            f"restart {restart} of {self.max_restarts}: {self.cause(failures)}; "
            f"{self.resume_text()}{self.traceback_note()}"
        )

    def final_line(self, failures: dict[int, ProcessFailure]) -> str:
        return (
            f"error: {self.cause(failures)}; not restarted: MAX_RESTARTS={self.max_restarts} "
            f"used up{self.traceback_note()}"
        )


def _trainer_config(trainer_args: list[str]) -> JobConfig:
    """The trainer's config, parsed without its warnings (the ranks print them)."""
    logger = logging.getLogger("torchtitan")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return ConfigManager().parse_args(trainer_args)
    finally:
        logger.setLevel(level)


def restart_report(args: Namespace) -> RestartReport | None:
    """For the trainer with restarts: the report, with the failure and traceback files named
    to the ranks in the environment; else None, and the environment names neither (a rank
    that fails then raises as under plain torchrun)."""
    os.environ.pop(FAILURE_FILE_ENV, None)
    os.environ.pop(TRACEBACK_FILE_ENV, None)
    if args.max_restarts < 1 or not (args.module and args.training_script == TRAINER_MODULE):
        return None
    config = _trainer_config(args.training_script_args)
    dump_folder = config.job.dump_folder
    if config.fault_tolerance.enable:
        dump_folder = replica_dump_folder(dump_folder, config.fault_tolerance.replica_id)
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    name = "tracebacks.log" if max_nodes == 1 else f"tracebacks.{socket.gethostname()}.log"
    traceback_file = Path(dump_folder) / name
    os.environ[TRACEBACK_FILE_ENV] = str(traceback_file)
    checkpoint = config.checkpoint
    return RestartReport(
        failure_file=_fresh_file("torchtitan-failures.", FAILURE_FILE_ENV),
        traceback_file=traceback_file,
        checkpoint_root=checkpoint_root(checkpoint.folder, dump_folder)
        if checkpoint.enable
        else None,
        max_restarts=args.max_restarts,
    )


class _QuietOnceReported(logging.Filter):
    """Drops torchrun's log lines about the workers failing and being stopped once a rank
    has recorded a user error, or a failure in the current attempt (the launcher prints
    that instead)."""

    def __init__(self, report_file: Path, restarts: RestartReport | None) -> None:
        super().__init__()
        self.report_file = report_file
        self.restarts = restarts

    def filter(self, record: logging.LogRecord) -> bool:
        if self.report_file.stat().st_size > 0:
            return False
        return self.restarts is None or self.restarts.recorded_failure() is None


class _TorchtitanAgent(LocalElasticAgent):
    """torchrun's agent, except that a failure in which some worker exited with the
    user-error code uses up the remaining restarts: the run stops instead. It also numbers
    each start of the ranks for them (in their inherited environment) and, with a restart
    report, prints its line before each restart after a failure."""

    report: RestartReport | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._failures: dict[int, ProcessFailure] = {}

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._failures and self.report is not None:
            restart = worker_group.spec.max_restarts - self._remaining_restarts
            line = self.report.restart_line(restart, self._failures)
            print(line, file=sys.stderr, flush=True)
        self._failures = {}
        os.environ[WORKER_START_ENV] = str(_current_attempt() + 1)
        return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.is_failed():
            self._failures = result.failures
            if any(f.exitcode == USER_ERROR_EXIT_CODE for f in result.failures.values()):
                self._remaining_restarts = 0
        return result


@contextlib.contextmanager
def _torchtitan_agent(report: RestartReport | None) -> Iterator[None]:
    """torchrun builds its agent from ``torch.distributed.launcher.api.LocalElasticAgent``;
    swap in ours while torchrun runs."""
    launcher_api.LocalElasticAgent = _TorchtitanAgent
    _TorchtitanAgent.report = report
    os.environ[WORKER_START_ENV] = "-1"
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = LocalElasticAgent
        _TorchtitanAgent.report = None


def _fresh_file(prefix: str, env_name: str) -> Path:
    """An empty temporary file, named to the ranks in the environment variable ``env_name``."""
    fd, name = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    os.environ[env_name] = name
    return Path(name)


def _final_line(
    failure: ChildFailedError, report_file: Path, restarts: RestartReport | None
) -> tuple[str, int] | None:
    """The one line that ends a failed run, with its exit code; None: torchrun's report."""
    if ended_on_user_error(failure, report_file):
        return f"error: {lowest_rank_error(report_file)}", USER_ERROR_EXIT_CODE
    if restarts is not None and restarts.recorded_failure() is not None:
        return restarts.final_line(failure.failures), 1
    return None


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        restarts = restart_report(args)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    report_file = _fresh_file("torchtitan-errors.", USER_ERROR_FILE_ENV)
    log_filter = _QuietOnceReported(report_file, restarts)
    logging.getLogger(_WORKER_MONITOR_LOGGER).addFilter(log_filter)
    try:
        with _torchtitan_agent(restarts):
            run(args)
        return 0
    except ChildFailedError as failure:
        final = _final_line(failure, report_file, restarts)
        if final is None:
            raise
        print(final[0], file=sys.stderr, flush=True)
        return final[1]
    finally:
        logging.getLogger(_WORKER_MONITOR_LOGGER).removeFilter(log_filter)
        report_file.unlink()
        if restarts is not None:
            restarts.failure_file.unlink()


if __name__ == "__main__":
    sys.exit(main())
