"""Imported by a replica group (``--experimental.custom_import``) to play a malicious peer:
the state it publishes for healing is a pickle whose unpickling would touch the file named
by ``MALICIOUS_HEAL_MARKER``."""

import io
import os
from pathlib import Path

import torch

from tests.crafted_checkpoints import Payload
from torchtitan.distributed.heal_transport import SafeHTTPTransport

MARKER_ENV = "MALICIOUS_HEAL_MARKER"


def _publish_payload(self, dst_ranks, step, state_dict, timeout) -> None:
    buffer = io.BytesIO()
    torch.save({"torchtitan": Payload(Path(os.environ[MARKER_ENV]))}, buffer)
    with self._published:
        self._payload = (step, buffer.getvalue())
        self._published.notify_all()


SafeHTTPTransport.send_checkpoint = _publish_payload
