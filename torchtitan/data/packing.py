"""Packing documents into fixed-length sequences, in an order that does not depend on the
data-parallel layout.

Shards: document ``i`` belongs to data shard ``i % S``. Each shard is packed on its own: its
documents are encoded with BOS/EOS, concatenated, and cut into non-overlapping windows of
``seq_len + 1`` tokens (input = window[:-1], label = window[1:]). A shard that runs out starts
its next epoch over its own documents; the partial window carries over the epoch boundary.

Whole documents (chat samples, ``pad_id`` set): a document that does not fit the rest of a
window starts the next one, and the rest of the window is padding; a document longer than a
window fills one window alone and loses its tail (logged once with the count).

Document ids: every sample carries, per input position, the index of the document the token
comes from, counted from 0 within the sample (a window that starts inside a document gives that
part id 0; padding has its own id). Documents are what the packer concatenates, never found
from EOS tokens in the text.

Labels: a document may mark which of its tokens are trained (a chat sample's assistant turns);
the label that predicts any other token, or padding, is ``IGNORE_INDEX``.

Global stream: position ``p`` is the ``(p // S)``-th sequence of shard ``p % S``; global batch
``k`` of ``G`` sequences is positions ``[k*G, (k+1)*G)``. Data-parallel rank ``r`` of ``dp``
reads the positions ``p % dp == r`` in increasing order. With ``dp | S`` a rank only touches the
shards ``s % dp == r`` and only tokenizes their documents, and the union of a global batch over
ranks is the same for every ``dp``.

Finite streams (validation) end at ``E = S * min_s n_s``, ``n_s`` being the number of complete
sequences of shard ``s`` in one epoch: the first position whose shard has no sequence left,
rounded down to a whole round of ``S`` positions so that every rank reads ``E / dp`` of them
whatever ``dp`` is.

State: one cursor per shard (epoch, document within the shard, tokens of that document already
consumed, sequences produced) plus the rank's next position. Restoring re-encodes the cursor's
document and skips the consumed tokens; no token buffer is stored.

Worker processes: a rank's positions are split into ``W`` parts by their index from the next
position modulo ``W``. With ``W`` dividing the rank's shard count, a shard's positions all fall
in one part, so each part reads and tokenizes only its own shards; taking one sample from each
part in turn restores the rank's order exactly, and each sample carries its shard's cursor, so
the consumer keeps the state of what it took, not of what workers prefetched.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass, field, replace
from typing import Any

import torch
from torch.utils.data import IterableDataset

from torchtitan.config.errors import ConfigError
from torchtitan.data.registry import Documents, is_indexable
from torchtitan.data.shards import IndexedDocuments, ShardedDocuments, StreamedDocuments
from torchtitan.layers.loss import IGNORE_INDEX

logger = logging.getLogger("torchtitan")

Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(input_ids, labels, document_ids), each of ``seq_len`` tokens."""

PartitionItem = tuple[Any, Sample]
"""(record, sample): what a loader worker delivers; the dataset's ``consume(record)`` moves its
state past the sample (a text dataset's record: position, shard, the shard's cursor after it)."""


@dataclass(frozen=True)
class EncodedDocument:
    """A document's tokens and, per token, whether it is trained (``targets``; None: all are).

    ``inner_starts``: offsets where another document of the same unit starts (a preference
    pair's rejected sequence after its chosen one): packed whole together, masked apart."""

    tokens: list[int]
    targets: list[bool] | None = None
    inner_starts: tuple[int, ...] = ()


Encoder = Callable[[Any], EncodedDocument]


@dataclass
class Window:
    """The tokens of one packed sequence (``seq_len + 1`` of them) and where its documents start."""

    tokens: list[int] = field(default_factory=list)
    targets: list[bool] = field(default_factory=list)
    starts: list[int] = field(
        default_factory=list
    )  # positions where a document (or its rest) begins
    truncated: bool = False  # a whole document lost its tail to fit

    def add(
        self, tokens: list[int], targets: list[bool] | None, inner_starts: tuple[int, ...] = ()
    ) -> None:
        start = len(self.tokens)
        self.starts.append(start)
        self.starts.extend(start + offset for offset in inner_starts if offset < len(tokens))
        self.tokens.extend(tokens)
        self.targets.extend([True] * len(tokens) if targets is None else targets)

    def sample(self) -> Sample:
        """Input and labels shifted by one token; the document id of every input position."""
        tokens = torch.tensor(self.tokens, dtype=torch.long)
        labels = torch.where(torch.tensor(self.targets[1:]), tokens[1:], IGNORE_INDEX)
        seq_len = len(self.tokens) - 1
        boundaries = torch.zeros(seq_len, dtype=torch.int32)
        boundaries[[start for start in self.starts if start < seq_len]] = 1
        return tokens[:-1], labels, boundaries.cumsum(0, dtype=torch.int32) - 1


@dataclass
class ShardCursor:
    """Where a shard's next token comes from."""

    epoch: int = 0
    doc: int = 0  # index of the document within the shard
    offset: int = 0  # tokens of that document already consumed
    sequences: int = 0  # sequences the shard has produced since the start


class ShardReader:
    """Cuts one shard's token stream into windows of ``window`` tokens, or packs its documents
    whole into windows padded with ``pad_id`` when that is set.

    ``describe`` starts the error raised for a shard without tokens (it names the config field).
    """

    def __init__(
        self,
        shard: int,
        documents: ShardedDocuments,
        encode: Encoder,
        window: int,
        describe: str,
        cursor: ShardCursor | None = None,
        pad_id: int | None = None,
    ) -> None:
        self.shard = shard
        self.cursor = cursor or ShardCursor()
        self._documents = documents
        self._encode = encode
        self._window = window
        self._describe = describe
        self._pad_id = pad_id
        self._encoded: EncodedDocument | None = None  # the document at the cursor
        self._epoch_has_tokens = self.cursor.doc > 0 or self.cursor.offset > 0
        documents.seek(shard, self.cursor.epoch, self.cursor.doc)

    def next_window(self) -> Window:
        out = Window()
        while len(out.tokens) < self._window:
            document = self._current_document()
            room = self._window - len(out.tokens)
            if self._pad_id is None:
                self._take(out, document, room)
            elif len(document.tokens) <= room or not out.tokens:
                out.truncated |= len(document.tokens) > room
                out.add(
                    document.tokens[:room],
                    document.targets and document.targets[:room],
                    document.inner_starts,
                )
                self._next_document()
            else:
                out.add([self._pad_id] * room, [False] * room)
        self.cursor.sequences += 1
        return out

    def _take(self, out: Window, document: EncodedDocument, room: int) -> None:
        """Up to ``room`` tokens of the document from the cursor on."""
        start = self.cursor.offset
        end = min(start + room, len(document.tokens))
        out.add(document.tokens[start:end], document.targets and document.targets[start:end])
        self.cursor.offset = end
        if end == len(document.tokens):
            self._next_document()

    def _next_document(self) -> None:
        self.cursor.doc, self.cursor.offset, self._encoded = self.cursor.doc + 1, 0, None

    def _current_document(self) -> EncodedDocument:
        """The document at the cursor, moving on past empty documents and epoch ends."""
        while self._encoded is None:
            cursor = self.cursor
            document = self._documents.get(self.shard, cursor.epoch, cursor.doc)
            if document is None:
                self._start_next_epoch()
                continue
            encoded = self._encode(document)
            if len(encoded.tokens) > cursor.offset:
                self._encoded, self._epoch_has_tokens = encoded, True
            else:
                self._next_document()
        return self._encoded

    def _start_next_epoch(self) -> None:
        if not self._epoch_has_tokens:
            raise ConfigError(
                f"{self._describe}: data shard {self.shard} yields no tokens "
                "(the dataset has fewer non-empty documents than data shards)"
            )
        self.cursor.epoch, self.cursor.doc, self.cursor.offset = self.cursor.epoch + 1, 0, 0
        self._epoch_has_tokens = False
        self._documents.seek(self.shard, self.cursor.epoch, 0)


def unite_shard_cursors(states: list[dict[str, Any]]) -> tuple[int, dict[str, list[int]]]:
    """The data shard count and the shard cursors of states that each hold some shards (each
    shard is read by one rank), refused when they disagree."""
    if not states:
        raise ValueError("merge_data_states: no states given")
    shard_counts = {state["data_shards"] for state in states}
    if len(shard_counts) != 1:
        raise ValueError(
            f"merge_data_states: the states disagree on data_shards: {sorted(shard_counts)}"
        )
    shards: dict[str, list[int]] = {}
    for state in states:
        for shard, cursor in state["shards"].items():
            if shard in shards and list(shards[shard]) != list(cursor):
                raise ValueError(
                    f"merge_data_states: two states hold different cursors for data shard {shard}"
                )
            shards[shard] = list(cursor)
    return shard_counts.pop(), dict(sorted(shards.items(), key=lambda item: int(item[0])))


def merge_shard_states(states: list[dict[str, Any]], partial: bool = False) -> dict[str, Any]:
    """``merge_data_states`` of a text dataset: the data states of all dp ranks combined into
    one state that loads under any dp degree (``partial``: the states of some ranks, whose
    shards alone the state then holds).

    Shard cursors are united (each shard belongs to one rank); the next position is the
    smallest over the ranks, i.e. the start of the first global batch not fully consumed.
    """
    num_shards, shards = unite_shard_cursors(states)
    missing = [s for s in range(num_shards) if str(s) not in shards]
    if missing and not partial:
        raise ValueError(
            f"merge_data_states: no state holds data shards {missing}; "
            "pass the states of all dp ranks"
        )
    return {
        "data_shards": num_shards,
        "next_position": min(state["next_position"] for state in states),
        "shards": shards,
    }


def saved_cursors(state: dict[str, Any], shards: list[int], reader: str) -> dict[int, ShardCursor]:
    """The cursors of ``shards`` in a saved state, refused when it lacks some (``reader`` names
    who reads them in the error)."""
    missing = [s for s in shards if str(s) not in state["shards"]]
    if missing:
        raise ValueError(
            f"data state: no cursors for data shards {missing} of {reader}; a state saved "
            "under another dp degree must be merged over all ranks with merge_data_states"
        )
    return {shard: ShardCursor(*state["shards"][str(shard)]) for shard in shards}


def _sequences_before(position: int, shard: int, num_shards: int) -> int:
    """How many positions below ``position`` belong to ``shard``."""
    return max(0, -(-(position - shard) // num_shards))


def _whole_windows(lengths: list[int], window: int) -> int:
    """Windows that documents of these lengths fill completely when packed whole (the last,
    partly filled one would take documents of the next epoch)."""
    closed, used = 0, 0
    for length in lengths:
        length = min(length, window)
        if used + length > window:
            closed, used = closed + 1, 0
        used += length
        if used == window:
            closed, used = closed + 1, 0
    return closed


class ShardedTextDataset(IterableDataset):
    """One dp rank's view of the global stream of packed sequences (see the module docstring).

    Yields ``(input_ids, labels, document_ids)``: LongTensors of ``seq_len`` and an IntTensor of
    ``seq_len`` (see the module docstring). ``encode`` turns a document into its tokens;
    ``pad_id`` set packs documents whole. Infinite datasets continue
    from their current state on every ``iter()``. Finite ones start from the beginning on every
    ``iter()`` unless a state was loaded since the last one.

    ``global_min`` reduces an int over the dp group (identity in one process); finite datasets
    call it once at the start of every iteration, so all ranks must iterate together.
    ``section`` (``training``/``validation``) names config fields in errors.
    """

    def __init__(
        self,
        *,
        name: str,
        documents: Documents,
        encode: Encoder,
        seq_len: int,
        dp_rank: int,
        dp_degree: int,
        data_shards: int,
        infinite: bool,
        pad_id: int | None = None,
        global_min: Callable[[int], int] | None = None,
        section: str = "training",
    ) -> None:
        super().__init__()
        self._name = name
        self._num_shards = data_shards
        self._dp_rank = dp_rank
        self._dp_degree = dp_degree
        self._window = seq_len + 1
        self._infinite = infinite
        self._global_min = global_min or (lambda x: x)
        self._section = section
        self._shards = list(range(dp_rank, data_shards, dp_degree))
        self._encode = encode
        self._pad_id = pad_id
        self._truncation_logged = False
        self._source = documents
        self._documents = self._shard_documents(documents, self._shards)
        self._shard_windows: dict[int, int] | None = None  # finite: windows per shard, once counted
        self._resume_pending = False
        self._restart()

    def _shard_documents(self, documents: Documents, shards: list[int]) -> ShardedDocuments:
        if hasattr(documents, "shard_documents"):  # a source with its own sharding (hf_source.py)
            return documents.shard_documents(self._num_shards, shards, self._section)
        if not is_indexable(documents):
            return StreamedDocuments(documents, self._num_shards, shards)
        if len(documents) < self._num_shards:
            raise ValueError(
                f"{self._section}.data_shards ({self._num_shards}) exceeds the number of documents "
                f"({len(documents)}) of dataset {self._name!r}; lower {self._section}.data_shards"
            )
        return IndexedDocuments(documents, self._num_shards)

    def _reader(
        self,
        shard: int,
        cursor: ShardCursor | None = None,
        documents: ShardedDocuments | None = None,
    ) -> ShardReader:
        describe = f"{self._section}.data_shards ({self._num_shards}) with dataset {self._name!r}"
        documents = self._documents if documents is None else documents
        return ShardReader(
            shard, documents, self._encode, self._window, describe, cursor, self._pad_id
        )

    @property
    def num_shards(self) -> int:
        return self._num_shards

    def shard_readers(self, cursors: dict[int, ShardCursor]) -> dict[int, ShardReader]:
        """Readers of these shards from their cursors (which they move), with the documents
        of these shards alone opened: a worker or a mixture's rank reads no other shard."""
        documents = self._shard_documents(self._source, sorted(cursors))
        return {shard: self._reader(shard, cursor, documents) for shard, cursor in cursors.items()}

    def sample_of(self, window: Window, shards: list[int] | None = None) -> Sample:
        """The window's sample; the first window that truncated a document logs how many of
        the documents of ``shards`` (default: this rank's) are too long."""
        if window.truncated and not self._truncation_logged:
            self._log_truncation(self._shards if shards is None else shards)
        return window.sample()

    def _restart(self) -> None:
        self._position = self._dp_rank
        self._readers = {shard: self._reader(shard) for shard in self._shards}

    def __iter__(self) -> Iterator[Sample]:
        if not self._infinite and not self._resume_pending:
            self._restart()
        self._resume_pending = False
        end = None if self._infinite else self._end_position()
        while end is None or self._position < end:
            position = self._position
            window = self._readers[position % self._num_shards].next_window()
            self._position = position + self._dp_degree
            yield self.sample_of(window)
        self._restart()

    def iter_partition(self, part: int, parts: int) -> Iterator[PartitionItem]:
        """Part ``part`` of ``parts`` of this (infinite) rank's stream from its current state, as
        a worker process produces it (see the module docstring): ``PartitionItem``s. Leaves this
        dataset's state untouched."""
        if not self._infinite or len(self._shards) % parts != 0:
            raise ValueError(
                "iter_partition: needs an infinite dataset and a divisor of "
                f"{len(self._shards)} parts"
            )
        first, stride = self._position + part * self._dp_degree, parts * self._dp_degree
        shards = sorted(
            {(first + k * stride) % self._num_shards for k in range(len(self._shards) // parts)}
        )
        readers = self.shard_readers({s: replace(self._readers[s].cursor) for s in shards})
        for position in itertools.count(first, stride):
            reader = readers[position % self._num_shards]
            sample = self.sample_of(reader.next_window())
            yield (position, reader.shard, astuple(reader.cursor)), sample

    def consume(self, record: tuple[int, int, tuple[int, ...]]) -> None:
        """Move the state past the sample a partition produced: ``record`` is its position, its
        shard and the shard's cursor after it."""
        position, shard, cursor = record
        if position != self._position:
            raise RuntimeError(
                f"data loader workers delivered position {position} where {self._position} was due"
            )
        self._readers[shard] = self._reader(shard, ShardCursor(*cursor))
        self._position = position + self._dp_degree

    def _end_position(self) -> int:
        if self._shard_windows is None:
            self._shard_windows = self._count_windows()
        local_end = self._num_shards * min(self._shard_windows.values())
        end = self._global_min(local_end)
        if end == 0:
            raise ValueError(
                f"{self._section}.dataset {self._name!r}: some of its {self._num_shards} "
                f"data shards hold less than one sequence of {self._section}.seq_len + 1 = "
                f"{self._window} tokens; lower {self._section}.data_shards or "
                f"{self._section}.seq_len"
            )
        return end

    def windows_per_epoch(self) -> int:
        """Whole windows one epoch of this rank's shards gives (tokenizes them once)."""
        if self._shard_windows is None:
            self._shard_windows = self._count_windows()
        return sum(self._shard_windows.values())

    def _epoch_lengths(self, shards: list[int] | None = None) -> dict[int, list[int]]:
        """Per shard (default: this rank's): the token counts of one epoch's documents."""
        shards = self._shards if shards is None else shards
        lengths: dict[int, list[int]] = {shard: [] for shard in shards}
        for shard, document in self._documents.iter_epoch(shards):
            lengths[shard].append(len(self._encode(document).tokens))
        return lengths

    def _count_windows(self) -> dict[int, int]:
        lengths = self._epoch_lengths()
        if self._pad_id is not None:
            return {
                shard: _whole_windows(counts, self._window) for shard, counts in lengths.items()
            }
        return {shard: sum(counts) // self._window for shard, counts in lengths.items()}

    def _log_truncation(self, shards: list[int]) -> None:
        """Warn once, with the count over one epoch of ``shards`` (this rank's)."""
        self._truncation_logged = True
        lengths = [length for counts in self._epoch_lengths(shards).values() for length in counts]
        too_long = sum(length > self._window for length in lengths)
        logger.warning(
            "%s.seq_len: %d of the %d samples of dataset %r on this rank are longer than "
            "%s.seq_len + 1 = %d tokens and lose their tail; "
            "raise %s.seq_len to train on them whole",
            self._section,
            too_long,
            len(lengths),
            self._name,
            self._section,
            self._window,
            self._section,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "data_shards": self._num_shards,
            "next_position": self._position,
            "shards": {
                str(shard): list(astuple(reader.cursor)) for shard, reader in self._readers.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load this rank's own state, or one merged over all ranks (any dp degree)."""
        field = f"{self._section}.data_shards"
        if state.get("data_shards") != self._num_shards:
            raise ValueError(
                f"{field}: the data state was saved with {state.get('data_shards')} data shards, "
                f"but {field} is {self._num_shards}"
            )
        next_position = state["next_position"]
        position = next_position + (self._dp_rank - next_position) % self._dp_degree
        cursors = saved_cursors(state, self._shards, f"dp rank {self._dp_rank}")
        for shard, cursor in cursors.items():
            expected = _sequences_before(position, shard, self._num_shards)
            if cursor.sequences != expected:
                raise ValueError(
                    f"data state is inconsistent: data shard {shard} produced "
                    f"{cursor.sequences} sequences, but next position {next_position} implies "
                    f"{expected}"
                )
        self._position = position
        self._readers = {shard: self._reader(shard, cursor) for shard, cursor in cursors.items()}
        self._resume_pending = True
