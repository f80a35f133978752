"""Training losses.

A train spec's loss (``build_loss_fn``) returns the SUM of the per-token losses over the
labels that are not :data:`IGNORE_INDEX`. The recipe divides it by the number of such labels
in the whole global batch (:class:`GlobalTokenMeanLoss`), so the gradient is the one of a
single big batch however the tokens fall into micro-batches, ranks and pipeline micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

IGNORE_INDEX = -100
"""A label that contributes nothing to the loss (prompt tokens, padding)."""


def cross_entropy_sum(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the valid labels, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the valid labels of one batch (for direct use; training
    normalises over the global batch instead)."""
    return F.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX
    )


def build_cross_entropy_loss() -> LossFn:
    """The train specs' ``build_loss_fn``: the summed cross-entropy."""
    return cross_entropy_sum


def valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many labels count in the loss (a 0-dim int64 tensor on the labels' device)."""
    return (labels != IGNORE_INDEX).sum()


class GlobalTokenMeanLoss:
    """``loss_sum(pred, labels) / divisor``, the divisor set once per step.

    Gradient reductions (FSDP, HSDP, DDP) average over the ``data_ranks`` ranks that hold
    different tokens (dp x cp), so each rank divides by ``global valid tokens / data_ranks``:
    the averaged gradient is then the sum over all tokens divided by their number. With the
    divisor unset (``None``) the loss is the plain sum (validation).
    """

    def __init__(self, loss_sum: LossFn) -> None:
        self.loss_sum = loss_sum
        self.divisor: torch.Tensor | None = None

    def set_global_tokens(self, tokens: torch.Tensor | None, data_ranks: int = 1) -> None:
        """``tokens``: valid labels of the whole global batch; None: sum, do not divide."""
        self.divisor = None if tokens is None else tokens.clamp(min=1) / data_ranks

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss_sum(pred, labels)
        return loss if self.divisor is None else loss / self.divisor
