"""``python -m torchtitan.distributed.launch [torchrun options] -m module args``: torchrun
(``torch.distributed.run``, in this process, so signals reach it as before) with one addition.

A rank that stops on bad input (a config value, a checkpoint that does not load, ...) records
``<rank><TAB><message>`` in the file named by ``TORCHTITAN_USER_ERROR_FILE`` and exits 2.
When the run ends that way (every failed worker exited 2, or was stopped by torchrun after
a peer did), this launcher prints the lowest such rank's message as one ``error:`` line and
exits 2, without torchrun's crash report and traceback; the one-process config check does
the same. Any other failure ends exactly as under torchrun.

With ``--max-restarts N`` (run_train.sh's ``MAX_RESTARTS``) torchrun restarts the ranks after
a failure, but never after a user error: bad input fails the same way again, and a crash
loop (``torchtitan.distributed.restarts``, which uses the failure file this launcher names)
is reported as one. The failure file, like the error file, is fresh for each launch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import parse_args, run

from torchtitan.config.entry import USER_ERROR_EXIT_CODE, USER_ERROR_FILE_ENV
from torchtitan.distributed.restarts import FAILURE_FILE_ENV, WORKER_START_ENV

_WORKER_MONITOR_LOGGER = "torch.distributed.elastic.multiprocessing.api"


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


class _QuietAfterUserError(logging.Filter):
    """Once a rank has recorded a user error, drops torchrun's log lines about the workers
    failing and being stopped (the launcher prints that error instead)."""

    def __init__(self, report_file: Path) -> None:
        super().__init__()
        self.report_file = report_file

    def filter(self, record: logging.LogRecord) -> bool:
        return self.report_file.stat().st_size == 0


class _TorchtitanAgent(LocalElasticAgent):
    """torchrun's agent, except that a failure in which some worker exited with the
    user-error code uses up the remaining restarts: the run stops instead. It also numbers
    each start of the ranks for them (in their inherited environment)."""

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        os.environ[WORKER_START_ENV] = str(int(os.environ.get(WORKER_START_ENV, "-1")) + 1)
        return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and any(
            f.exitcode == USER_ERROR_EXIT_CODE for f in result.failures.values()
        ):
            self._remaining_restarts = 0
        return result


@contextlib.contextmanager
def _torchtitan_agent() -> Iterator[None]:
    """torchrun builds its agent from ``torch.distributed.launcher.api.LocalElasticAgent``;
    swap in ours while torchrun runs."""
    launcher_api.LocalElasticAgent = _TorchtitanAgent
    os.environ.pop(WORKER_START_ENV, None)
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = LocalElasticAgent


def _fresh_file(prefix: str, env_name: str) -> Path:
    """An empty temporary file, named to the ranks in the environment variable ``env_name``."""
    fd, name = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    os.environ[env_name] = name
    return Path(name)


@record
def main(argv: list[str] | None = None) -> int:
    report_file = _fresh_file("torchtitan-errors.", USER_ERROR_FILE_ENV)
    failure_file = _fresh_file("torchtitan-failures.", FAILURE_FILE_ENV)
    log_filter = _QuietAfterUserError(report_file)
    logging.getLogger(_WORKER_MONITOR_LOGGER).addFilter(log_filter)
    try:
        with _torchtitan_agent():
            run(parse_args(argv))
        return 0
    except ChildFailedError as failure:
        if not ended_on_user_error(failure, report_file):
            raise
        print(f"error: {lowest_rank_error(report_file)}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    finally:
        logging.getLogger(_WORKER_MONITOR_LOGGER).removeFilter(log_filter)
        report_file.unlink()
        failure_file.unlink()


if __name__ == "__main__":
    sys.exit(main())
