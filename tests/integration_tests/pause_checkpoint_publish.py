"""Test-only hook (loaded with ``--experimental.custom_import``): rank 0 pauses with a
finished but unpublished ``step-N.tmp`` on disk, so that a test can kill the run in the
middle of a save. Importing this module installs the hook: never import it from a test (the
pytest process would then pause on every asynchronous save); the line it logs lives in
``pause_line.py``."""

from __future__ import annotations

import time

from tests.integration_tests.pause_line import PAUSE_LINE
from torchtitan.components.checkpointing.manager import CheckpointManager
from torchtitan.tools.logging import logger

PAUSE_SECONDS = 120

_publish_when_written = CheckpointManager._finish


def _pause_then_publish(self, upload, tmp, final, manifest, start) -> None:
    if upload is not None:
        upload.result()
    logger.warning(f"{PAUSE_LINE} {tmp}")
    time.sleep(PAUSE_SECONDS)
    _publish_when_written(self, None, tmp, final, manifest, start)


CheckpointManager._finish = _pause_then_publish
