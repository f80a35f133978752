"""Shared entry-point handling: parse the config, turn bad input into one line + exit 2."""

from __future__ import annotations

import sys

from torchtitan.config.manager import ConfigError, ConfigManager, config_to_toml


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


def _pop_world_size(argv: list[str]) -> tuple[list[str], int | None, bool]:
    out, world_size, i = [], None, 0
    print_loss_rank = "--print-loss-rank" in argv
    argv = [a for a in argv if a != "--print-loss-rank"]
    while i < len(argv):
        if argv[i] == "--world-size" and i + 1 < len(argv):
            world_size = int(argv[i + 1])
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out, world_size, print_loss_rank


@config_errors_exit
def main(argv: list[str]) -> int:
    argv, world_size, print_loss_rank = _pop_world_size(argv)
    config = ConfigManager().parse_args(argv)
    if world_size is not None:
        from torchtitan.config.preflight import preflight
        from torchtitan.distributed.parallel_dims import default_device_type

        parallel_dims = preflight(config, world_size, default_device_type())
        if print_loss_rank:
            from torchtitan.distributed.pipeline import loss_owner_rank

            print(loss_owner_rank(config, world_size, parallel_dims))
        return 0
    print(config_to_toml(config), end="")
    return 0
