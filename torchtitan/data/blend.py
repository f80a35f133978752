"""How many samples of each source a global batch takes in a weighted mixture.

Every global batch of ``G`` samples takes ``c_k`` samples from source ``k`` such that the
cumulative count ``C_k`` stays within one sample of its target (the weight times the samples
so far): the deficits ``target_k - C_k`` of the coming batch are rounded down, and the samples
still missing go to the largest remainders (ties to the lower source index), which keeps every
source's error in (-1, 1) at every batch boundary, the bound Megatron's blended dataset keeps.
A source whose epoch cap is reached stops taking samples; the others share its weight from
then on. Inside a batch the sources' samples come in source order, so the global batch (and
which source sample sits at which position) is the same under every data-parallel layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """One global batch: per source, the first source sample it takes and how many."""

    firsts: tuple[int, ...]
    counts: tuple[int, ...]

    def locate(self, offset: int) -> tuple[int, int]:
        """(source, source sample) of the batch's ``offset``-th sample."""
        for source, count in enumerate(self.counts):
            if offset < count:
                return source, self.firsts[source] + offset
            offset -= count
        raise IndexError(f"offset {offset} is past the batch")


class Blend:
    """The per-batch counts of a mixture; ``plan(b)`` walks batches from the last one asked.

    ``caps``: per source, the number of samples after which it is exhausted (None: never).
    """

    def __init__(self, weights: list[float], batch_size: int, caps: list[int | None]) -> None:
        if not weights or any(w <= 0 for w in weights):
            raise ValueError(f"mixture weights must be > 0, got {weights}")
        self.weights = weights
        self.batch_size = batch_size
        self.caps = caps
        self._batch = 0
        self._counts = [0] * len(weights)
        self._targets = [0.0] * len(weights)
        self._last_plan: tuple[int, BatchPlan] | None = None

    def counts_before(self, batch: int) -> list[int]:
        """Samples each source gave to the batches before ``batch``."""
        if self._last_plan is not None and batch == self._batch - 1:
            return list(self._last_plan[1].firsts)
        if batch < self._batch:  # an earlier batch: recount from the start
            self._batch, self._last_plan = 0, None
            self._counts, self._targets = [0] * len(self.weights), [0.0] * len(self.weights)
        while self._batch < batch:
            self._step()
        return list(self._counts)

    def plan(self, batch: int) -> BatchPlan:
        """Which source samples global batch ``batch`` holds (cached for the latest batch)."""
        if self._last_plan is not None and self._last_plan[0] == batch:
            return self._last_plan[1]
        firsts = self.counts_before(batch)
        self._step()
        counts = [after - before for after, before in zip(self._counts, firsts)]
        self._last_plan = (batch, BatchPlan(tuple(firsts), tuple(counts)))
        return self._last_plan[1]

    def _active(self) -> list[int]:
        active = [k for k, cap in enumerate(self.caps) if cap is None or self._counts[k] < cap]
        if not active:
            raise StopIteration  # every source is exhausted
        return active

    def _step(self) -> None:
        active = self._active()
        total = sum(self.weights[k] for k in active)
        for k in active:
            self._targets[k] += self.batch_size * self.weights[k] / total
        deficits = {k: self._targets[k] - self._counts[k] for k in active}
        taken = {k: max(0, math.floor(d)) for k, d in deficits.items()}
        if self.caps:
            taken = {k: min(t, self._room(k)) for k, t in taken.items()}
        missing = self.batch_size - sum(taken.values())
        order = sorted(active, key=lambda k: (-(deficits[k] - taken[k]), k))
        while missing > 0:
            candidates = [k for k in order if taken[k] < self._room(k)]
            if not candidates:
                raise StopIteration
            taken[candidates[0]] += 1
            missing -= 1
            order = sorted(active, key=lambda k: (-(deficits[k] - taken[k]), k))
        while missing < 0:
            k = next(k for k in reversed(order) if taken[k] > 0)
            taken[k] -= 1
            missing += 1
            order = sorted(active, key=lambda k: (-(deficits[k] - taken[k]), k))
        for k, count in taken.items():
            self._counts[k] += count
        self._batch += 1

    def _room(self, source: int) -> int | float:
        cap = self.caps[source]
        return math.inf if cap is None else cap - self._counts[source]
