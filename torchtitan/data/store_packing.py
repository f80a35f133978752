"""The packed sequences of a token store, by random access, under the text datasets' rules
(``packing.py``): document ``i`` belongs to data shard ``i % S``; a shard's documents are
concatenated, epoch after epoch, and cut into windows of ``seq_len + 1`` tokens; global
position ``p`` is window ``p // S`` of shard ``p % S``. A store's documents are already
encoded, so a window is found by a binary search in the shard's cumulative lengths instead of
by reading the shard from its start: any sequence costs the same, which is what shuffling and
mixtures need, and the state is the next position alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from torchtitan.data.packing import Sample
from torchtitan.data.token_store import TokenStore


class ShardLayout:
    """Data shard ``shard`` of ``S``: its documents and their cumulative token counts."""

    def __init__(self, store: TokenStore, shard: int, num_shards: int) -> None:
        self.store = store
        self.documents = np.arange(shard, store.num_documents, num_shards, dtype=np.int64)
        starts, ends = store.document_bounds(self.documents)
        self.starts = starts
        self.cumulative = np.concatenate([[0], np.cumsum(ends - starts)])

    @property
    def tokens(self) -> int:
        """Tokens of one epoch of the shard."""
        return int(self.cumulative[-1])

    def pieces(self, first: int, count: int) -> list[np.ndarray]:
        """Tokens ``[first, first + count)`` of the shard's endless stream, one array per
        document piece (each piece starts a document id in the packed sample)."""
        pieces, position = [], first
        while count > 0:
            epoch_offset = position % self.tokens
            k = int(np.searchsorted(self.cumulative, epoch_offset, side="right")) - 1
            offset = epoch_offset - int(self.cumulative[k])
            take = min(count, int(self.cumulative[k + 1]) - epoch_offset)
            start = int(self.starts[k]) + offset
            pieces.append(self.store.tokens(start, start + take))
            position, count = position + take, count - take
        return pieces


class StoreSequences:
    """Random access to the packed sequences of ``store`` with ``num_shards`` data shards."""

    def __init__(self, store: TokenStore, num_shards: int, seq_len: int) -> None:
        self.store = store
        self.num_shards = num_shards
        self.window = seq_len + 1
        self._layouts: dict[int, ShardLayout] = {}

    def layout(self, shard: int) -> ShardLayout:
        if shard not in self._layouts:
            layout = ShardLayout(self.store, shard, self.num_shards)
            if layout.tokens == 0:
                raise ValueError(
                    f"data shard {shard} of {self.num_shards} of token store {self.store.folder} "
                    "holds no tokens (fewer documents than data shards); lower data_shards"
                )
            self._layouts[shard] = layout
        return self._layouts[shard]

    def windows_per_epoch(self, shard: int) -> int:
        """Whole windows in one epoch of ``shard`` (what a finite stream takes from it)."""
        return self.layout(shard).tokens // self.window

    @cached_property
    def sequences_per_epoch(self) -> int:
        """Windows of one pass over the whole store."""
        return max(1, self.store.num_tokens // self.window)

    def sequence(self, position: int) -> Sample:
        """The sample at global stream position ``position``."""
        shard, index = position % self.num_shards, position // self.num_shards
        pieces = self.layout(shard).pieces(index * self.window, self.window)
        tokens = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        boundaries = torch.zeros(self.window - 1, dtype=torch.int32)
        starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
        boundaries[torch.from_numpy(starts[starts < self.window - 1])] = 1
        return tokens[:-1], tokens[1:].clone(), boundaries.cumsum(0, dtype=torch.int32) - 1


class FiniteStoreDataset(IterableDataset):
    """Rank ``dp_rank`` of ``dp_degree``'s share of one pass over a store (validation): the
    positions below ``S * min_s windows_per_epoch(s)``, as the finite text datasets end; every
    ``iter()`` starts from the beginning."""

    def __init__(self, sequences: StoreSequences, dp_rank: int, dp_degree: int) -> None:
        super().__init__()
        self.sequences = sequences
        self._dp_rank = dp_rank
        self._dp_degree = dp_degree
        shards = range(sequences.num_shards)
        self._end = sequences.num_shards * min(sequences.windows_per_epoch(s) for s in shards)
        if self._end == 0:
            raise ValueError(
                f"token store {sequences.store.folder}: a data shard holds less than one "
                f"sequence of seq_len + 1 = {sequences.window} tokens; lower data_shards or seq_len"
            )

    def __iter__(self) -> Iterator[Sample]:
        for position in range(self._dp_rank, self._end, self._dp_degree):
            yield self.sequences.sequence(position)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
