"""A data-parallel rank's share of a global stream built from sources by position: a weighted
mixture of sources (``blend.py``), each optionally shuffled (``shuffle.py``), or one token store.

Global position ``p`` belongs to global batch ``p // G`` (``G`` = the global batch size, the
same under every layout); the batch's plan says which source and which source sample sits at
``p``, the source's shuffle moves that sample index, and the source returns the sample. Rank
``r`` of ``dp`` takes the positions ``p % dp == r``, so a global batch is the same set of
samples under every dp degree, and the state is the next position alone (text sources add the
state of their own stream), loadable under any dp degree.

Sources:

- ``StoreSource``: a token store, by random access (``store_packing.py``);
- ``TextSource``: a text dataset read as one stream (dp degree 1: its data shards in their
  order); a rank reads the samples the plan gives it in increasing order and skips the others,
  so every rank tokenizes the whole source: fine for small sources, a token store is the
  way for large ones. It cannot be shuffled (that needs random access).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from torch.utils.data import IterableDataset

from torchtitan.data.blend import Blend
from torchtitan.data.packing import Sample, ShardedTextDataset
from torchtitan.data.shuffle import BlockShuffle
from torchtitan.data.store_packing import StoreSequences

logger = logging.getLogger("torchtitan")


class Source(Protocol):
    name: str

    def sample(self, index: int) -> Sample:
        """The source's ``index``-th sample."""

    @property
    def samples_per_epoch(self) -> int:
        """Samples of one pass over the source's data."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StoreSource:
    """A token store's packed sequences, optionally shuffled within blocks."""

    def __init__(self, name: str, sequences: StoreSequences, shuffle: BlockShuffle | None) -> None:
        self.name = name
        self.sequences = sequences
        self.shuffle = shuffle

    def sample(self, index: int) -> Sample:
        return self.sequences.sequence(self.shuffle(index) if self.shuffle else index)

    @property
    def samples_per_epoch(self) -> int:
        return self.sequences.sequences_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """Nothing to restore (positions are random access); what the positions mean is
        recorded, so a resume with other data shards, sequence length or shuffle is refused."""
        shuffle = [self.shuffle.seed, self.shuffle.window] if self.shuffle else None
        return {
            "data_shards": self.sequences.num_shards,
            "seq_len": self.sequences.window - 1,
            "shuffle": shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        changed = [key for key in mine if key in state and state[key] != mine[key]]
        if changed:
            saved = ", ".join(f"{key} {state[key]}" for key in changed)
            now = ", ".join(f"{key} {mine[key]}" for key in changed)
            raise ValueError(
                f"data state: source {self.name!r} was saved with {saved}; this run has {now}, "
                "which would train on other sequences (training.data_shards, seq_len, "
                "shuffle_seed/shuffle_window)"
            )


class TextSource:
    """A text dataset's stream (dp degree 1), read forward: ``sample(i)`` needs ``i`` at or
    after the last sample read; the samples in between are skipped (still tokenized)."""

    def __init__(self, name: str, stream: ShardedTextDataset) -> None:
        self.name = name
        self._stream = stream
        self._iterator: Iterator[Sample] | None = None
        self._next = 0
        self._noted: dict[str, Any] | None = None  # the state a loader worker's copy reached

    def sample(self, index: int) -> Sample:
        self._noted = None
        if index < self._next:
            raise RuntimeError(f"text source {self.name!r}: sample {index} was already read")
        if self._iterator is None:
            self._iterator = iter(self._stream)
        while self._next < index:
            next(self._iterator)
            self._next += 1
        self._next += 1
        return next(self._iterator)

    @property
    def samples_per_epoch(self) -> int:
        """Whole windows of one pass (tokenizes the source once: only asked with max_epochs)."""
        return self._stream.windows_per_epoch()

    def note_state(self, state: dict[str, Any]) -> None:
        """The state a loader worker's copy of this source reached when it read the sample the
        training loop took last (the one this process returns in ``state_dict``)."""
        self._noted = state

    def state_dict(self) -> dict[str, Any]:
        return self._noted if self._noted is not None else self._stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._noted = None
        self._stream.load_state_dict(state)
        self._next = state["next_position"]
        self._iterator = None


@dataclass(frozen=True)
class Weighted:
    source: Source
    weight: float
    max_epochs: float | None = None


class MixedDataset(IterableDataset):
    """Rank ``dp_rank`` of ``dp_degree``'s samples of the blended global stream (infinite)."""

    def __init__(
        self, sources: list[Weighted], global_batch: int, dp_rank: int, dp_degree: int
    ) -> None:
        super().__init__()
        if global_batch % dp_degree != 0:
            raise ValueError(
                f"the mixture's global batch ({global_batch}) must be divisible by the "
                f"data-parallel degree ({dp_degree})"
            )
        self.sources = [w.source for w in sources]
        caps = [
            None if w.max_epochs is None else int(w.max_epochs * w.source.samples_per_epoch)
            for w in sources
        ]
        self._blend = Blend([w.weight for w in sources], global_batch, caps)
        self._global_batch = global_batch
        self._dp_rank = dp_rank
        self._dp_degree = dp_degree
        self._position = dp_rank

    def __iter__(self) -> Iterator[Sample]:
        while True:
            try:
                yield self._take()
            except StopIteration:  # every source reached its epoch cap
                logger.warning("the data mixture is exhausted: every source reached its max_epochs")
                return

    def _take(self) -> Sample:
        sample = self._sample_at(self._position)
        self._position += self._dp_degree
        return sample

    def _sample_at(self, position: int) -> Sample:
        batch, offset = divmod(position, self._global_batch)
        source, index = self._blend.plan(batch).locate(offset)
        return self.sources[source].sample(index)

    def iter_partition(self, part: int, parts: int) -> Iterator[tuple[Any, Sample]]:
        """Part ``part`` of ``parts`` of this rank's stream from its current state, as a loader
        worker produces it: every ``parts``-th of the rank's positions, each with its record
        (the position, and the states of the text sources after it). Stores are read at random,
        so any number of parts works; each part reads the text sources forward on its own (it
        runs in its own process, with its own copy of them)."""
        texts = [source for source in self.sources if isinstance(source, TextSource)]
        first, stride = self._position + part * self._dp_degree, parts * self._dp_degree
        position = first
        while True:
            try:
                sample = self._sample_at(position)
            except StopIteration:  # every source reached its epoch cap
                return
            states = {source.name: source.state_dict() for source in texts}
            yield (position, states), sample
            position += stride

    def consume(self, record: tuple[int, dict[str, Any]]) -> None:
        """Move the state past the sample a partition produced (see ``iter_partition``)."""
        position, text_states = record
        if position != self._position:
            raise RuntimeError(
                f"data loader workers delivered position {position} where {self._position} was due"
            )
        self._position = position + self._dp_degree
        for source in self.sources:
            if source.name in text_states:
                source.note_state(text_states[source.name])

    def source_samples(self) -> dict[str, int]:
        """Samples each source gave to the global batches before this rank's next position."""
        counts = self._blend.counts_before(self._position // self._global_batch)
        return {source.name: count for source, count in zip(self.sources, counts)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_batch": self._global_batch,
            "next_position": self._position,
            "sources": {s.name: s.state_dict() for s in self.sources},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's own state, or one merged over all ranks (any dp degree)."""
        if state.get("global_batch") != self._global_batch:
            raise ValueError(
                f"data state: saved with a global batch of {state.get('global_batch')} samples, "
                f"this run has {self._global_batch}; the mixture's batches would differ"
            )
        names = sorted(s.name for s in self.sources)
        if sorted(state["sources"]) != names:
            raise ValueError(
                f"data state: saved for the sources {sorted(state['sources'])}, "
                f"this run has {names}"
            )
        next_position = state["next_position"]
        self._position = next_position + (self._dp_rank - next_position) % self._dp_degree
        for source in self.sources:
            if state["sources"][source.name]:
                source.load_state_dict(state["sources"][source.name])


def merge_mixture_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The state every rank resumes from: the smallest next position (the first global batch
    not fully consumed); a text source resumes from the rank that read furthest in it (every
    rank reads it as one stream, so any rank's state is a valid one to fast-forward from)."""
    first = min(states, key=lambda s: s["next_position"])
    sources = {}
    for name, state in first["sources"].items():
        if "next_position" in state:  # a text source's stream
            candidates = [s["sources"][name] for s in states]
            state = max(candidates, key=lambda s: s["next_position"])
        sources[name] = state
    return {**first, "sources": sources}


def shuffle_for(
    seed: int | None, window: int, samples_per_epoch: int, name: str
) -> BlockShuffle | None:
    """The source's shuffle: None without a seed; ``window`` 0 shuffles whole passes."""
    if seed is None:
        return None
    return BlockShuffle(seed, window or samples_per_epoch, salt=name)
