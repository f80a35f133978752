"""``python -m torchtitan.distributed.launch [torchrun options] -m module args``: torchrun
(``torch.distributed.run``, in this process, so signals reach it as before) with one addition.

A rank that stops on bad input (a config value, a checkpoint that does not load, ...) prints
one ``error:`` line, records the error in the file named by ``TORCHTITAN_USER_ERROR_FILE``
and exits 0, so that torchrun has no failed worker to report with its crash report and
traceback; this launcher then exits 2, as the one-process config check does. Any other
failure ends exactly as under torchrun.
"""

from __future__ import annotations

import os
import sys
import tempfile

from torch.distributed.run import main as torchrun_main

from torchtitan.config.entry import USER_ERROR_FILE_ENV


def main(argv: list[str] | None = None) -> int:
    fd, report_file = tempfile.mkstemp(prefix="torchtitan-errors.")
    os.close(fd)
    os.environ[USER_ERROR_FILE_ENV] = report_file
    try:
        torchrun_main(argv)
        return 2 if os.path.getsize(report_file) > 0 else 0
    finally:
        os.unlink(report_file)


if __name__ == "__main__":
    sys.exit(main())
