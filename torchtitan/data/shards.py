"""Per-shard access to a dataset's documents.

Document ``i`` belongs to shard ``i % S``; the ``j``-th document of shard ``s`` is document
``s + j * S``. Every epoch of a shard visits its documents in that same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class ShardedDocuments(Protocol):
    def get(self, shard: int, epoch: int, j: int) -> Any | None:
        """The shard's ``j``-th document in ``epoch``, or None past the shard's last document."""

    def seek(self, shard: int, epoch: int, j: int) -> None:
        """Announce that the shard's next ``get`` is (epoch, j) (lets a stream cache ahead)."""

    def iter_epoch(self, shards: Sequence[int]) -> Iterator[tuple[int, Any]]:
        """(shard, document) for one epoch of the given shards' documents, in document order."""


class IndexedDocuments:
    """Shards of an indexable document collection."""

    def __init__(self, documents: Sequence[Any], num_shards: int) -> None:
        self._documents = documents
        self._num_shards = num_shards

    def get(self, shard: int, epoch: int, j: int) -> Any | None:
        index = shard + j * self._num_shards
        return self._documents[index] if index < len(self._documents) else None

    def seek(self, shard: int, epoch: int, j: int) -> None:
        pass

    def iter_epoch(self, shards: Sequence[int]) -> Iterator[tuple[int, Any]]:
        wanted = set(shards)
        for index in range(len(self._documents)):
            if index % self._num_shards in wanted:
                yield index % self._num_shards, self._documents[index]


@dataclass
class _Pass:
    """One iteration over the stream: the next document's index, and documents read ahead."""

    iterator: Iterator[Any]
    position: int = 0
    exhausted: bool = False
    cache: dict[int, Any] = field(default_factory=dict)


class StreamedDocuments:
    """Shards of a re-iterable stream; document ``i`` is the ``i``-th one iterated.

    One pass over the stream per epoch serves all of the rank's shards: documents of the rank's
    shards that arrive before their shard asks for them are cached, but only those at or after
    the shard's announced next read, so the cache holds no more than the spread between the
    rank's fastest and slowest shard. A read behind the pass (rare: a shard that was not
    announced) restarts that epoch's pass.
    """

    def __init__(self, stream: Iterable[Any], num_shards: int, shards: Sequence[int]) -> None:
        self._stream = stream
        self._num_shards = num_shards
        self._next_read: dict[int, tuple[int, int]] = {s: (0, 0) for s in shards}
        self._passes: dict[int, _Pass] = {}

    def seek(self, shard: int, epoch: int, j: int) -> None:
        self._next_read[shard] = (epoch, j)
        oldest = min(e for e, _ in self._next_read.values())
        for stale in [e for e in self._passes if e < oldest]:
            del self._passes[stale]

    def get(self, shard: int, epoch: int, j: int) -> Any | None:
        self.seek(shard, epoch, j + 1)
        index = shard + j * self._num_shards
        current = self._passes.get(epoch)
        if current is not None and index in current.cache:
            return current.cache.pop(index)
        if current is None or index < current.position:
            current = self._passes[epoch] = _Pass(iter(self._stream))
        return self._advance_to(current, epoch, index)

    def _advance_to(self, current: _Pass, epoch: int, index: int) -> Any | None:
        while not current.exhausted:
            document = next(current.iterator, _END)
            if document is _END:
                current.exhausted = True
                break
            position = current.position
            current.position += 1
            if position == index:
                return document
            if self._wanted_later(position, epoch):
                current.cache[position] = document
        return None

    def _wanted_later(self, index: int, epoch: int) -> bool:
        next_read = self._next_read.get(index % self._num_shards)
        return (
            next_read is not None
            and next_read[0] == epoch
            and next_read[1] <= index // self._num_shards
        )

    def iter_epoch(self, shards: Sequence[int]) -> Iterator[tuple[int, Any]]:
        wanted = set(shards)
        for index, document in enumerate(self._stream):
            if index % self._num_shards in wanted:
                yield index % self._num_shards, document


_END = object()
