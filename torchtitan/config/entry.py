"""Shared entry-point handling: parse the config, turn bad input into one line + exit 2."""

from __future__ import annotations

import sys

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import ConfigManager, config_to_toml


def config_errors_exit(fn):
    """Decorator: a ConfigError (or ValueError from config-level checks) prints one line
    ``error: ...`` on stderr and exits with code 2, instead of a traceback."""

    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper


@config_errors_exit
def main(argv: list[str]) -> int:
    """Print the merged config as TOML."""
    print(config_to_toml(ConfigManager().parse_args(argv)), end="")
    return 0
