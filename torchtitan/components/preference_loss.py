"""DPO's losses on packed preference pairs (``data/preference.py``'s layout: in each row,
document ``2k`` is pair k's prompt + chosen, ``2k + 1`` its prompt + rejected, labels only on
the completions).

The losses are TRL's DPOTrainer's (the judge in the tests): with Δ = (log π(chosen) −
log π_ref(chosen)) − (log π(rejected) − log π_ref(rejected)), each a sum over the completion's
tokens,

- ``sigmoid`` (DPO): −log σ(β Δ);
- ``robust`` (rDPO, ``label_smoothing`` ε the assumed rate of flipped labels):
  (−(1 − ε) log σ(β Δ) + ε log σ(−β Δ)) / (1 − 2ε);
- ``ipo``: ((Δ_chosen / n_chosen − Δ_rejected / n_rejected) − 1 / (2β))², each side's
  log-ratio divided by its completion's token count, as TRL does.

A step's loss is the mean over the global batch's pairs. Everything stays on the device: pairs
are counted with masks, never by indexing with them (no host sync).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchtitan.layers.loss import IGNORE_INDEX, token_logps

LOSS_TYPES = ("sigmoid", "robust", "ipo")


@dataclass
class PairLogps:
    """Per pair slot ``[rows, slots]`` of the packed rows: the completions' summed log-probs,
    their token counts, and which slots hold a pair."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    present: torch.Tensor


def pair_logps(
    logps: torch.Tensor,
    labels: torch.Tensor,
    document_ids: torch.Tensor,
    *,
    slots: int | None = None,
    combine: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> PairLogps:
    """Sums ``logps`` (``token_logps``) per document, then splits even (chosen) and odd
    (rejected) documents into pair slots; a slot holds a pair where both completions have
    labels. Under context parallel the rows are this rank's share of the sequences:
    ``slots`` is then the whole sequence's (``pair_slots``) and ``combine`` sums the
    per-document sums and token counts over the ranks holding the other shares."""
    rows, seq = labels.shape
    document_ids = document_ids.long()
    width = 2 * (pair_slots(seq) if slots is None else slots)
    trained = (labels != IGNORE_INDEX).to(logps.dtype)
    sums = logps.new_zeros(rows, width).scatter_add(1, document_ids, logps * trained)
    counts = logps.new_zeros(rows, width).scatter_add(1, document_ids, trained)
    if combine is not None:
        sums, counts = combine(torch.stack([sums, counts])).unbind(0)
    chosen_tokens, rejected_tokens = counts[:, 0::2], counts[:, 1::2]
    return PairLogps(
        chosen=sums[:, 0::2],
        rejected=sums[:, 1::2],
        chosen_tokens=chosen_tokens,
        rejected_tokens=rejected_tokens,
        present=(chosen_tokens > 0) & (rejected_tokens > 0),
    )


def pair_slots(seq_len: int) -> int:
    """Pair slots of a packed row of ``seq_len`` tokens (each document at least one token)."""
    return (seq_len + 1) // 2


@dataclass(frozen=True)
class DPOSettings:
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0


def per_pair_loss(policy: PairLogps, reference: PairLogps, settings: DPOSettings) -> torch.Tensor:
    """Each slot's loss ``[rows, slots]`` (0 where no pair)."""
    chosen_ratio = policy.chosen - reference.chosen
    rejected_ratio = policy.rejected - reference.rejected
    beta, smoothing = settings.beta, settings.label_smoothing
    if settings.loss_type == "sigmoid":
        loss = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    elif settings.loss_type == "robust":
        delta = beta * (chosen_ratio - rejected_ratio)
        loss = (-(1 - smoothing) * F.logsigmoid(delta) + smoothing * F.logsigmoid(-delta)) / (
            1 - 2 * smoothing
        )
    elif settings.loss_type == "ipo":
        per_token = chosen_ratio / policy.chosen_tokens.clamp(min=1.0) - (
            rejected_ratio / policy.rejected_tokens.clamp(min=1.0)
        )
        loss = (per_token - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss type {settings.loss_type!r}; one of {LOSS_TYPES}")
    return torch.where(policy.present, loss, torch.zeros_like(loss))


@dataclass
class PreferenceSums:
    """A micro-batch's sums over its pairs (divide by the global pair count): the loss's share
    and the metrics TRL logs."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    correct: torch.Tensor
    pairs: torch.Tensor


def preference_sums(
    policy: PairLogps, reference: PairLogps, settings: DPOSettings
) -> PreferenceSums:
    """Summed loss and metrics of the pairs present (rewards are β × log-ratio, detached;
    ``correct`` counts pairs whose chosen reward is above the rejected one)."""
    present = policy.present.to(policy.chosen.dtype)
    with torch.no_grad():
        chosen_rewards = settings.beta * (policy.chosen - reference.chosen) * present
        rejected_rewards = settings.beta * (policy.rejected - reference.rejected) * present
        correct = (chosen_rewards > rejected_rewards).to(present.dtype) * present
    return PreferenceSums(
        loss=per_pair_loss(policy, reference, settings).sum(),
        chosen_rewards=chosen_rewards.sum(),
        rejected_rewards=rejected_rewards.sum(),
        correct=correct.sum(),
        pairs=present.sum(),
    )


def count_pairs(labels: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """Pairs in a micro-batch (a 0-dim tensor on its device), read from labels alone."""
    zeros = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    return pair_logps(zeros, labels, document_ids).present.sum()


class PreferenceLoss:
    """A micro-batch's share of the step's DPO loss: its pairs' summed loss divided by the
    global batch's pairs over the data ranks (set once per step, as ``GlobalTokenMeanLoss``
    does with tokens, so that the averaged gradient is the mean over all pairs). Keeps the
    step's metric sums on the device."""

    def __init__(self, settings: DPOSettings) -> None:
        self.settings = settings
        self.divisor: torch.Tensor | None = None
        self.metric_sums: list[torch.Tensor] = []

    def set_global_pairs(self, pairs: torch.Tensor, data_ranks: int) -> None:
        self.divisor = pairs.clamp(min=1) / data_ranks
        self.metric_sums = []

    def __call__(
        self,
        logits: torch.Tensor,
        reference: PairLogps,
        labels: torch.Tensor,
        document_ids: torch.Tensor,
        *,
        slots: int | None = None,
        combine: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``slots`` and ``combine``: as ``pair_logps`` takes them (context parallel)."""
        logps = token_logps(logits, labels)
        policy = pair_logps(logps, labels, document_ids, slots=slots, combine=combine)
        sums = preference_sums(policy, reference, self.settings)
        self.metric_sums.append(
            torch.stack([sums.chosen_rewards, sums.rejected_rewards, sums.correct, sums.pairs])
        )
        return sums.loss / self.divisor

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of a pipeline micro-batch, whose ``target`` is ``pipeline_target``'s."""
        labels, document_ids, reference = unpack_pipeline_target(target)
        return self(logits, pair_logps(reference, labels, document_ids), labels, document_ids)

    def drop_stand_in_calls(self, calls_before: int, microbatches: int) -> None:
        """Keep, of the calls since ``calls_before``, the last ``microbatches``: a pipeline
        schedule's first step also calls the loss on a stand-in micro-batch (to infer
        gradient shapes) before the real ones."""
        del self.metric_sums[calls_before : len(self.metric_sums) - microbatches]

    def step_metric_sums(self, device: torch.device) -> torch.Tensor:
        """This rank's sums over the step: chosen rewards, rejected rewards, correctly
        ordered pairs, pairs (zeros on pipeline stages without the loss)."""
        if not self.metric_sums:
            return torch.zeros(4, device=device)
        return torch.stack(self.metric_sums).sum(0)


def pipeline_target(
    labels: torch.Tensor, document_ids: torch.Tensor, reference: torch.Tensor
) -> torch.Tensor:
    """One ``[batch, seq, 3]`` tensor holding the labels, document ids and the reference's
    token log-probabilities: a pipeline schedule splits one target tensor into micro-batches
    and hands each to the loss. float64 holds all three exactly."""
    return torch.stack([labels.double(), document_ids.double(), reference.double()], dim=-1)


def unpack_pipeline_target(
    target: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pipeline_target``'s labels, document ids and reference token log-probabilities."""
    labels, document_ids, reference = target.unbind(-1)
    return labels.long(), document_ids.long(), reference.float()


def metrics_from_sums(sums: torch.Tensor) -> dict[str, float]:
    """TRL's names for the global batch's means (``sums`` summed over the data ranks)."""
    chosen, rejected, correct, pairs = sums.tolist()
    pairs = max(pairs, 1.0)
    return {
        "rewards/chosen": chosen / pairs,
        "rewards/rejected": rejected / pairs,
        "rewards/margins": (chosen - rejected) / pairs,
        "rewards/accuracies": correct / pairs,
        "pairs": int(pairs),
    }
