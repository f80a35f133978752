"""Training losses."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

IGNORE_INDEX = -100
"""A label that contributes nothing to the loss (prompt tokens, padding)."""


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def build_cross_entropy_loss(job_config) -> LossFn:
    return cross_entropy_loss


def rescale_accumulated_loss(loss_fn: LossFn, accumulation_steps: int) -> LossFn:
    """Divide each micro-batch loss so that accumulated gradients equal the full-batch mean."""
    if accumulation_steps == 1:
        return loss_fn

    def scaled(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(pred, labels) / accumulation_steps

    return scaled
