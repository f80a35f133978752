"""``python -m torchtitan.config --job.config_file F.toml [overrides]``: print the merged
config (with ``--show-sources``: and the file each value came from). With ``--world-size
N`` (used by run_train.sh) instead validate the parallel layout for N processes
(``--print-loss-rank`` prints the rank that shows the loss): that check lives above
``config/``, in ``torchtitan.preflight``; this entry point only dispatches to it. Bad
input: one line on stderr, exit code 2."""

import sys

if __name__ == "__main__":
    if "--world-size" in sys.argv:
        from torchtitan.preflight import main
    else:
        from torchtitan.config.entry import main
    sys.exit(main(sys.argv[1:]))
