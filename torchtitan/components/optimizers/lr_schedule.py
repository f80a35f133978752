"""Warmup -> (stable) -> decay learning-rate schedules.

For the optimizer step with 0-based index i of a schedule of N steps (lr_scheduler.total_steps,
default training.steps), W warmup steps and D decay steps (D = round(N * decay_ratio), or N - W
when decay_ratio is unset); steps past N keep the final factor:
  i < W:          factor = (i + 1) / (W + 1)                 (never exactly 0)
  W <= i < N - D: factor = 1                                 (stable phase)
  i >= N - D:     p = (i - (N - D)) / D, factor = m + (1 - m) * g(p)
with g(p) = 1 - p (linear), 1 - sqrt(p) (sqrt) or (1 + cos(pi p)) / 2 (cosine) and
m = min_lr_factor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import LRSchedulerConfig


def lr_factor(
    step_index: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    total_steps: int,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    decay_start = total_steps - decay_steps
    if step_index < warmup_steps:
        return (step_index + 1) / (warmup_steps + 1)
    if step_index < decay_start:
        return 1.0
    progress = min((step_index - decay_start) / max(decay_steps, 1), 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type: unknown {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def schedule_lengths(
    total_steps: int, warmup_steps: int, decay_ratio: float | None
) -> tuple[int, int]:
    """(warmup, decay) step counts, shrinking warmup if it would overlap the decay."""
    decay_steps = (
        round(total_steps * decay_ratio) if decay_ratio is not None else total_steps - warmup_steps
    )
    decay_steps = max(decay_steps, 0)
    if warmup_steps + decay_steps > total_steps:
        new_warmup = max(total_steps - decay_steps, 0)
        logger.warning(
            f"lr_scheduler: warmup_steps ({warmup_steps}) + decay steps ({decay_steps}) exceed "
            f"the schedule's {total_steps} steps; warmup shortened to {new_warmup}"
        )
        warmup_steps = new_warmup
    return warmup_steps, decay_steps


class LRSchedulersContainer(Stateful):
    """One LambdaLR per optimizer, stepped together; all follow the same schedule."""

    def __init__(self, optimizers, factor_fn) -> None:
        self.schedulers = [LambdaLR(opt, factor_fn) for opt in optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        # Identical across schedulers; the step count is what matters.
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Every scheduler resumes at the saved step; the saved base lrs are the first
        optimizer's, so the others (Muon's AdamW, with its own lr) keep theirs."""
        self.schedulers[0].load_state_dict(dict(state_dict))
        position = {k: v for k, v in state_dict.items() if k not in ("base_lrs", "_last_lr")}
        for s in self.schedulers[1:]:
            s.load_state_dict({**s.state_dict(), **position})


def configured_lr_factor(
    lr_scheduler: LRSchedulerConfig, training_steps: int
) -> Callable[[int], float]:
    """step index -> learning-rate factor, for the ``[lr_scheduler]`` schedule (its length
    ``lr_scheduler.total_steps``, default ``training_steps``)."""
    cfg = lr_scheduler
    total = cfg.total_steps or training_steps
    warmup, decay = schedule_lengths(total, cfg.warmup_steps, cfg.decay_ratio)
    return functools.partial(
        lr_factor,
        warmup_steps=warmup,
        decay_steps=decay,
        total_steps=total,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )


def build_lr_schedulers(
    optimizers: Iterable[torch.optim.Optimizer],
    lr_scheduler: LRSchedulerConfig,
    training_steps: int,
) -> LRSchedulersContainer:
    return LRSchedulersContainer(optimizers, configured_lr_factor(lr_scheduler, training_steps))
