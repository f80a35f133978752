"""Shared entry-point handling: parse the config, turn bad input into one line + exit 2."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import ConfigManager, config_to_toml
from torchtitan.config.requirements import check_torch_version

USER_ERROR_FILE_ENV = "TORCHTITAN_USER_ERROR_FILE"
"""Set by ``torchtitan.distributed.launch`` (what run_train.sh runs) for its ranks: a rank that
stops on a user error appends the message there and exits 0, so that torchrun prints no crash
report of its own; the launcher then exits 2."""


def exit_on_user_error(message: str) -> NoReturn:
    """Print ``error: message`` on stderr and exit 2 (or hand the error to run_train.sh)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    report_file = os.environ.get(USER_ERROR_FILE_ENV)
    if report_file:
        with open(report_file, "a") as f:
            f.write(message + "\n")
        sys.exit(0)
    sys.exit(2)


def config_errors_exit(fn):
    """Decorator for entry points: first checks the installed torch is new enough; then a
    ConfigError (bad input found anywhere, also inside the ranks) prints one line
    ``error: ...`` on stderr and exits with code 2, instead of a traceback."""

    def wrapper(*args, **kwargs):
        try:
            check_torch_version()
            return fn(*args, **kwargs)
        except ConfigError as e:
            exit_on_user_error(str(e))

    return wrapper


SHOW_SOURCES_FLAG = "--show-sources"


@config_errors_exit
def main(argv: list[str]) -> int:
    """Print the merged config as TOML; with --show-sources, each line also says which
    file (or the command line, or the default) its value came from."""
    show_sources = SHOW_SOURCES_FLAG in argv
    manager = ConfigManager()
    config = manager.parse_args([a for a in argv if a != SHOW_SOURCES_FLAG])
    print(config_to_toml(config, manager.sources if show_sources else None), end="")
    return 0
