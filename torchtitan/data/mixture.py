"""A data-parallel rank's share of a global stream built from sources by position: a weighted
mixture of sources (``blend.py``), each optionally shuffled (``shuffle.py``), or one token store.

Global position ``p`` belongs to global batch ``p // G`` (``G`` = the global batch size, the
same under every layout); the batch's plan says which source sits at ``p`` and which of its
samples, and the source returns the sample. Rank ``r`` of ``dp`` takes the positions
``p % dp == r``, so a global batch is the same set of samples under every dp degree, and the
state is the next position (plus the shard cursors of text sources), loadable under any dp
degree.

Sources:

- ``StoreSource``: a token store, by random access (``store_packing.py``); a rank reads the
  sequences at its positions alone. It can be shuffled.
- ``TextSource``: a text or ``hf`` dataset packed per data shard as ``packing.py`` does
  (``S`` = ``data_shards``), placed by position: the source's sample at position ``p`` is the
  next window of shard ``p % S``. With ``dp | S`` every position of shard ``s`` falls on rank
  ``s % dp``, so a rank reads and tokenizes its own shards alone, each in order, and a
  shard's cursor (kept by the rank that reads it) says where it resumes under any dp degree.
  It cannot be shuffled (packing is sequential), and a ``max_epochs`` cap counts the windows
  of all its shards once (every rank tokenizes the whole source for that count).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import astuple, dataclass, replace
from typing import Any, Protocol

from torch.utils.data import IterableDataset

from torchtitan.data.blend import Blend
from torchtitan.data.packing import (
    Sample,
    ShardCursor,
    ShardedTextDataset,
    ShardReader,
    saved_cursors,
    unite_shard_cursors,
)
from torchtitan.data.shuffle import BlockShuffle
from torchtitan.data.store_packing import StoreSequences

logger = logging.getLogger("torchtitan")


class Source(Protocol):
    name: str

    def sample(self, index: int, position: int) -> Sample:
        """The source's ``index``-th sample, which the global ``position`` takes."""

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

    def sample(self, index: int, position: int) -> Sample:
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


TextRecord = tuple[str, int, tuple[int, ...]] | None
"""What a text source's sample moves: (source name, data shard, the shard's cursor after it)."""


class TextSource:
    """A text dataset's windows placed by position (see the module docstring); ``stream``
    holds all its data shards (dp degree 1), of which this rank opens its own."""

    def __init__(self, name: str, stream: ShardedTextDataset, dp_rank: int, dp_degree: int) -> None:
        if stream.num_shards % dp_degree != 0:
            raise ValueError(
                f"training.data_shards ({stream.num_shards}) must be divisible by the "
                f"data-parallel degree ({dp_degree}) for the text source {name!r}: each rank "
                "reads whole data shards of it"
            )
        self.name = name
        self._stream = stream
        self._cursors = {s: ShardCursor() for s in range(dp_rank, stream.num_shards, dp_degree)}
        self._readers: dict[int, ShardReader] | None = None  # opened on the first read here

    @property
    def num_shards(self) -> int:
        return self._stream.num_shards

    @property
    def shards_per_rank(self) -> int:
        return len(self._cursors)

    def sample(self, index: int, position: int) -> Sample:
        if self._readers is None:
            self._readers = self._stream.shard_readers(self._cursors)
        return self.read(position, self._readers)[0]

    def part_readers(self, shards: list[int]) -> dict[int, ShardReader]:
        """Readers of some of this rank's shards from copies of their cursors (a loader
        worker's part), leaving this source's state as it is."""
        return self._stream.shard_readers({s: replace(self._cursors[s]) for s in shards})

    def read(self, position: int, readers: dict[int, ShardReader]) -> tuple[Sample, TextRecord]:
        """The sample at ``position`` from ``readers``, with the record that moves a state past
        it (``advance``)."""
        reader = readers[position % self._stream.num_shards]
        sample = self._stream.sample_of(reader.next_window(), list(self._cursors))
        return sample, (self.name, reader.shard, astuple(reader.cursor))

    @property
    def samples_per_epoch(self) -> int:
        """Whole windows of one pass over all shards (tokenizes them once: only asked with
        max_epochs)."""
        return self._stream.windows_per_epoch()

    def advance(self, shard: int, cursor: tuple[int, ...]) -> None:
        """Take the cursor a loader worker's copy of this source reached in ``shard``."""
        self._cursors[shard] = ShardCursor(*cursor)
        self._readers = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard cursors (``merge_mixture_states`` unites the ranks')."""
        return {
            "data_shards": self._stream.num_shards,
            "shards": {str(s): list(astuple(c)) for s, c in self._cursors.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        num_shards = self._stream.num_shards
        if state.get("data_shards") != num_shards:
            raise ValueError(
                f"data state: source {self.name!r} was saved with data_shards "
                f"{state.get('data_shards')}; this run has data_shards {num_shards}, which "
                "would train on other sequences (training.data_shards)"
            )
        self._cursors = saved_cursors(state, list(self._cursors), f"source {self.name!r}")
        self._readers = None


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

    def _locate(self, position: int) -> tuple[Source, int]:
        """The source at ``position`` and the index of its sample there."""
        batch, offset = divmod(position, self._global_batch)
        source, index = self._blend.plan(batch).locate(offset)
        return self.sources[source], index

    def _sample_at(self, position: int) -> Sample:
        source, index = self._locate(position)
        return source.sample(index, position)

    @property
    def text_shards_per_rank(self) -> int | None:
        """The data shards each rank reads of every text source (None: no text source)."""
        texts = self._text_sources()
        return texts[0].shards_per_rank if texts else None

    def _text_sources(self) -> list[TextSource]:
        return [source for source in self.sources if isinstance(source, TextSource)]

    def iter_partition(self, part: int, parts: int) -> Iterator[tuple[Any, Sample]]:
        """Part ``part`` of ``parts`` of this rank's stream from its current state, as a loader
        worker produces it: every ``parts``-th of the rank's positions, each with its record
        (the position, and a text source's ``TextRecord``). Stores are read at random, so any
        number of parts works; with text sources ``parts`` divides the rank's data shards,
        so that a shard's positions all fall in one part, which reads its shards alone."""
        first, stride = self._position + part * self._dp_degree, parts * self._dp_degree
        texts = self._text_sources()
        readers = {}
        if texts:
            count, num_shards = texts[0].shards_per_rank // parts, texts[0].num_shards
            shards = sorted({(first + k * stride) % num_shards for k in range(count)})
            readers = {text.name: text.part_readers(shards) for text in texts}
        position = first
        while True:
            try:
                source, index = self._locate(position)
            except StopIteration:  # every source reached its epoch cap
                return
            if isinstance(source, TextSource):
                sample, record = source.read(position, readers[source.name])
            else:
                sample, record = source.sample(index, position), None
            yield (position, record), sample
            position += stride

    def consume(self, record: tuple[int, TextRecord]) -> None:
        """Move the state past the sample a partition produced (see ``iter_partition``)."""
        position, text = record
        if position != self._position:
            raise RuntimeError(
                f"data loader workers delivered position {position} where {self._position} was due"
            )
        self._position = position + self._dp_degree
        if text is not None:
            name, shard, cursor = text
            next(s for s in self._text_sources() if s.name == name).advance(shard, cursor)

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
    not fully consumed); a text source's shard cursors united over the ranks (each shard is
    read by one rank)."""
    first = min(states, key=lambda s: s["next_position"])
    sources = {}
    for name, state in first["sources"].items():
        if "shards" in state:  # a text source
            num_shards, cursors = unite_shard_cursors([s["sources"][name] for s in states])
            state = {"data_shards": num_shards, "shards": cursors}
        sources[name] = state
    return {**first, "sources": sources}


def shuffle_for(
    seed: int | None, window: int, samples_per_epoch: int, name: str
) -> BlockShuffle | None:
    """The source's shuffle: None without a seed; ``window`` 0 shuffles whole passes."""
    if seed is None:
        return None
    return BlockShuffle(seed, window or samples_per_epoch, salt=name)
