"""Shared entry-point handling: parse the config, turn bad input into one line + exit 2."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from torchtitan.config.errors import ConfigError, UserInputError
from torchtitan.config.parsing import ConfigManager, config_to_toml
from torchtitan.config.requirements import check_torch_version

USER_ERROR_EXIT_CODE = 2

USER_ERROR_FILE_ENV = "TORCHTITAN_USER_ERROR_FILE"
"""Set by ``torchtitan.distributed.launch`` (what run_train.sh runs) for its ranks: a rank that
stops on a user error appends ``<rank><TAB><message>`` there instead of printing it and exits
2; the launcher then prints the lowest rank's message once, without torchrun's crash report."""


def report_user_error(message: str) -> None:
    """Print ``error: message`` on stderr, or under the launcher record it for the launcher
    to print once."""
    report_file = os.environ.get(USER_ERROR_FILE_ENV)
    if report_file:
        with open(report_file, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')}\t{message}\n")
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)


def exit_on_user_error(message: str) -> NoReturn:
    report_user_error(message)
    sys.exit(USER_ERROR_EXIT_CODE)


def peer_reported_user_error() -> bool:
    """Under the launcher: whether a rank on this node has recorded a user error. A rank
    that fails after that (a peer left in the middle of a collective) fails as its
    consequence and exits quietly with the same code."""
    report_file = os.environ.get(USER_ERROR_FILE_ENV)
    return bool(report_file) and os.path.getsize(report_file) > 0


def config_errors_exit(fn):
    """Decorator for entry points: first checks the installed torch is new enough; then a
    UserInputError (bad input found anywhere, also inside the ranks) prints one line
    ``error: ...`` on stderr and exits with code 2, instead of a traceback; so does
    (silently) any failure that follows a peer rank's user error."""

    def wrapper(*args, **kwargs):
        try:
            check_torch_version()
            return fn(*args, **kwargs)
        except UserInputError as e:
            exit_on_user_error(str(e))
        except Exception:
            if peer_reported_user_error():
                sys.exit(USER_ERROR_EXIT_CODE)
            raise

    return wrapper


SHOW_SOURCES_FLAG = "--show-sources"


@config_errors_exit
def main(argv: list[str]) -> int:
    """Print the merged config as TOML; with --show-sources, each line also says which
    file (or the command line, or the default) its value came from."""
    if "--world-size" in argv:
        raise ConfigError(
            "--world-size: the layout check for N processes is "
            "python -m torchtitan.preflight --world-size N [config flags]"
        )
    show_sources = SHOW_SOURCES_FLAG in argv
    manager = ConfigManager()
    config = manager.parse_args([a for a in argv if a != SHOW_SOURCES_FLAG])
    print(config_to_toml(config, manager.sources if show_sources else None), end="")
    return 0
