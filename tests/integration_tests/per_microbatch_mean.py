"""Test-only planted error (loaded with ``--experimental.custom_import``): each micro-batch's
loss is its own token mean divided by the number of micro-batches (4 in the test), the
normalisation the global-token mean replaces. With micro-batches of unequal valid-token
counts it must fail the parity check."""

from __future__ import annotations

from torchtitan.layers.loss import GlobalTokenMeanLoss, valid_tokens

MICRO_BATCHES = 4


def _per_microbatch_mean(self, pred, labels):
    return self.loss_sum(pred, labels) / valid_tokens(labels).clamp(min=1) / MICRO_BATCHES


GlobalTokenMeanLoss.__call__ = _per_microbatch_mean
