"""CheckpointManager (being built for the checkpointing issue; the config refuses
checkpoint.enable until it lands, so only the disabled path runs here)."""

from __future__ import annotations

from typing import Any


class CheckpointManager:
    def __init__(self, *, dataloader, model_parts, optimizers, lr_schedulers,
                 states: dict[str, Any], job_config, parallel_dims, train_spec=None) -> None:
        self.enable = job_config.checkpoint.enable

    def load(self, step: int = -1) -> bool:
        return False

    def save(self, curr_step: int, last_step: bool = False, force: bool = False) -> None:
        return None

    def maybe_wait_for_staging(self) -> None:
        return None

    def close(self) -> None:
        return None
