"""``python -m torchtitan.config --job.config_file F.toml [overrides]``: print the merged
config. With ``--world-size N`` (used by run_train.sh) instead validate the parallel layout
for N processes (``--print-loss-rank`` prints the rank that shows the loss). Bad input: one
line on stderr, exit code 2."""

import sys

from torchtitan.config.entry import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
