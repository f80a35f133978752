"""``python -m torchtitan.config --job.config_file F.toml [overrides]``: print the merged
config (with ``--show-sources``: and the file each value came from). Bad input: one line on
stderr, exit code 2. The layout check for N processes is ``python -m torchtitan.preflight
--world-size N``."""

import sys

from torchtitan.config.entry import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
