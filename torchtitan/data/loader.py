"""Data loaders of packed text sequences whose order does not depend on the dp layout.

See ``torchtitan/data/packing.py`` for the order and the state. Batches are
``({"input": LongTensor[B, seq_len], "document_ids": IntTensor[B, seq_len]},
labels LongTensor[B, seq_len])``: ``document_ids[b, p]`` numbers the documents of sample ``b``
from 0 along the sequence, so two positions share an id exactly when they come from the same
document. Labels hold ``IGNORE_INDEX`` where nothing is trained (prompt tokens and padding of
chat data).

Errors in the data or its config fields reach ``build_dataloader``'s caller as ``ConfigError``
(one line, exit 2 at the entry point).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.config.errors import ConfigError
from torchtitan.data import ShardedTextDataset, load_documents
from torchtitan.data.encoding import encoding
from torchtitan.data.mixture import MixedDataset
from torchtitan.data.packing import PartitionItem, Sample
from torchtitan.data.token_loaders import (
    source_configs,
    source_name,
    training_dataset,
    uses_sources,
    validation_datasets,
)
from torchtitan.protocols.tokenizer import BaseTokenizer
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import HFDatasetConfig, TrainingConfig, ValidationConfig
    from torchtitan.distributed import ParallelDims

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]

DEFAULT_DATA_SHARDS = 64


def _collate(samples: list[Sample]) -> Batch:
    inputs, labels, document_ids = zip(*samples, strict=True)
    return {"input": torch.stack(inputs), "document_ids": torch.stack(document_ids)}, torch.stack(
        labels
    )


class SequenceDataLoader:
    """Batches of a dataset of packed sequences (a ``ShardedTextDataset``, a token store's or a
    mixture's ``MixedDataset``), read in this process or in ``num_workers`` worker processes;
    the same batches in the same order either way.

    Worker processes are torchdata's ``StatefulDataLoader``'s (fork, per-worker prefetch,
    shutdown); what they read is ours: worker ``w`` of ``W`` produces every ``W``-th sample of
    the rank's stream from the current state (``iter_partition``), in chunks of a batch's
    size, and the loader takes one chunk from each worker in turn and interleaves them, which
    restores the rank's order exactly. Each sample
    carries the record that moves the state past it (``consume``), so the state is that of the
    samples taken, whatever the workers prefetched. ``StatefulDataLoader``'s own state is not
    used: it restores one state per worker into the same worker count, where ours is one
    position that any dp degree and worker count load; a loaded state starts new workers
    from it. At most ``num_workers * prefetch_factor`` batches are in flight (default
    ``prefetch_factor`` 2), which bounds the host memory they hold. ``persistent_workers``
    keeps the workers (and their prefetched samples) from one ``iter()`` to the next; loading
    a state stops them. Pinning (``pin_memory``) happens after collation, where an
    accelerator is present (a pin thread would pin each sample, and stacking them unpins).

    ``state_dict()`` returns the dataset's state (see ``merge_data_states``);
    ``load_state_dict`` accepts the rank's own state or one merged over all ranks; an empty
    state is a no-op.
    """

    def __init__(
        self,
        dataset: ShardedTextDataset | MixedDataset,
        batch_size: int,
        seq_len: int = 0,
        num_workers: int = 0,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.seq_len = seq_len
        self._num_workers = num_workers
        self._persistent_workers = persistent_workers
        self._prefetch_factor = prefetch_factor or 2
        self._pin_memory = pin_memory and torch.accelerator.is_available()
        self._worker_samples: Iterator[Sample] | None = None

    def __iter__(self) -> Iterator[Batch]:
        samples = iter(self.dataset) if self._num_workers == 0 else self._samples_from_workers()
        while chunk := list(itertools.islice(samples, self.batch_size)):
            batch = _collate(chunk)
            yield _pinned(batch) if self._pin_memory else batch

    def _samples_from_workers(self) -> Iterator[Sample]:
        if self._worker_samples is None or not self._persistent_workers:
            self.close()
            self._worker_samples = self._start_workers()
        return self._worker_samples

    def close(self) -> None:
        """Stop the worker processes now (a new ``iter()`` starts others). Without it they
        stop only when the garbage collector finds the abandoned iterator, and if it does so
        inside an import, each worker's shutdown waits its full 5 s timeout."""
        if self._worker_samples is not None:
            self._worker_samples.close()
            self._worker_samples = None

    def _start_workers(self) -> Iterator[Sample]:
        from torchdata.stateful_dataloader import StatefulDataLoader

        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            loader = StatefulDataLoader(
                _WorkerPartitions(self.dataset, self.batch_size),
                batch_size=None,
                num_workers=self._num_workers,
                prefetch_factor=self._prefetch_factor,  # chunks of a batch's size per worker
            )
        chunks = iter(loader)
        while True:
            round_ = list(itertools.islice(chunks, self._num_workers))
            failed = next((item for item in round_ if isinstance(item, ConfigError)), None)
            if failed is not None:
                raise failed
            if not round_:
                return
            for record, sample in _interleaved(round_):
                self.dataset.consume(record)
                yield sample

    def metrics(self) -> dict[str, float]:
        """Per source of a mixture, the tokens the global batches so far took from it
        (deterministic: no communication); nothing for one source."""
        if not isinstance(self.dataset, MixedDataset) or len(self.dataset.sources) < 2:
            return {}
        samples = self.dataset.source_samples()
        return {f"tokens/{name}": count * self.seq_len for name, count in samples.items()}

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.dataset.load_state_dict(state_dict)
        self.close()  # the next iter() starts workers from the state


Chunk = tuple[list[Any], tuple[torch.Tensor, ...]]
"""A worker's next samples: their records and their tensors stacked (one transfer per field
instead of one per sample: per-sample transfers cost more than a store read)."""


class _WorkerPartitions(IterableDataset):
    """In worker ``w`` of ``W``: part ``w`` of ``W`` of the dataset's stream, in chunks of
    ``chunk`` samples. Bad data ends it with the ``ConfigError`` as its last item, which the
    loader raises as it is (torch would wrap it in a multi-line report)."""

    def __init__(self, dataset: ShardedTextDataset | MixedDataset, chunk: int) -> None:
        super().__init__()
        self._dataset = dataset
        self._chunk = chunk

    def __iter__(self) -> Iterator[Chunk | ConfigError]:
        worker = get_worker_info()
        items = self._dataset.iter_partition(worker.id, worker.num_workers)
        try:
            while chunk := list(itertools.islice(items, self._chunk)):
                records, samples = zip(*chunk, strict=True)
                yield list(records), tuple(torch.stack(field) for field in zip(*samples))
        except ConfigError as e:
            yield e


def _interleaved(round_: list[Chunk]) -> Iterator[PartitionItem]:
    """The samples of one chunk from each worker in the rank's order: worker ``w``'s ``j``-th
    sample is the round's sample ``j * W + w`` (the last round's chunks may be shorter)."""
    longest = max(len(records) for records, _ in round_)
    for j in range(longest):
        for records, tensors in round_:
            if j < len(records):
                yield records[j], tuple(tensor[j] for tensor in tensors)


def _pinned(batch: Batch) -> Batch:
    inputs, labels = batch
    return {key: tensor.pin_memory() for key, tensor in inputs.items()}, labels.pin_memory()


def _check_positive(section: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{section}.{name} must be a positive integer, got {value!r}")


def build_text_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: BaseTokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    data_shards: int = DEFAULT_DATA_SHARDS,
    infinite: bool = True,
    global_min: Callable[[int], int] | None = None,
    num_workers: int = 0,
    section: str = "training",
    hf: HFDatasetConfig | None = None,
    **loader_options: Any,
) -> SequenceDataLoader:
    """A loader over dp rank ``dp_rank``'s share of the global sequence stream.

    ``hf``: how to read an ``hf`` dataset (defaults when None).
    ``global_min`` (finite loaders) reduces an int with MIN over the dp group; the default is
    the identity, right for one process. ``section`` names the config section in errors.
    ``num_workers`` > 0 (infinite loaders only) must divide the data shards of a dp rank.
    ``loader_options``: ``SequenceDataLoader``'s ``persistent_workers``, ``prefetch_factor``,
    ``pin_memory``.
    """
    _check_positive(
        section, seq_len=seq_len, local_batch_size=local_batch_size, data_shards=data_shards
    )
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank {dp_rank} is outside the data-parallel degree {dp_degree}")
    if data_shards % dp_degree != 0:
        raise ValueError(
            f"{section}.data_shards ({data_shards}) must be divisible by the data-parallel "
            f"degree ({dp_degree})"
        )
    _check_workers(num_workers, data_shards // dp_degree, infinite, section)
    if loader_options.get("pin_memory") and not torch.accelerator.is_available():
        logger.warning(
            f"{section}.dataloader.pin_memory: no accelerator on this machine; "
            "batches are not pinned"
        )
    config, documents = load_documents(dataset, dataset_path, section, hf)
    encode, pad_id = encoding(config, tokenizer, section, seq_len)
    text_dataset = ShardedTextDataset(
        name=dataset,
        documents=documents,
        encode=encode,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        data_shards=data_shards,
        infinite=infinite,
        pad_id=pad_id,
        global_min=global_min,
        section=section,
    )
    return SequenceDataLoader(
        text_dataset,
        batch_size=local_batch_size,
        seq_len=seq_len,
        num_workers=num_workers,
        **loader_options,
    )


def _check_workers(num_workers: int, shards_per_rank: int, infinite: bool, section: str) -> None:
    if num_workers == 0:
        return
    if not infinite:
        raise ValueError(
            f"{section}.dataloader.num_workers: the finite {section} loader reads in the training "
            f"process; leave it at 0"
        )
    if shards_per_rank % num_workers != 0:
        raise ValueError(
            f"{section}.dataloader.num_workers ({num_workers}) must divide the data shards of "
            f"each dp rank ({section}.data_shards / dp degree = {shards_per_rank}); "
            "each worker reads whole shards"
        )


def _dp_layout(parallel_dims: Any) -> tuple[int, int, Any]:
    """(dp rank, dp degree, dp mesh or None)."""
    if parallel_dims is None or not parallel_dims.dp_enabled:
        return 0, 1, None
    mesh = parallel_dims.world_mesh["dp"]
    return mesh.get_local_rank(), mesh.size(), mesh


def _mesh_global_min(mesh: Any) -> Callable[[int], int]:
    def global_min(value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=mesh.device_type)
        torch.distributed.all_reduce(
            tensor, op=torch.distributed.ReduceOp.MIN, group=mesh.get_group()
        )
        return int(tensor.item())

    return global_min


def build_dataloader(
    data: TrainingConfig | ValidationConfig,
    parallel_dims: ParallelDims | None,
    tokenizer: BaseTokenizer,
    split: str = "train",
) -> SequenceDataLoader:
    """The train loader (infinite, from ``[training]``) or the validation loader (finite, from
    ``[validation]``; one source): ``data`` is that section.

    Each uses its section's ``dataloader`` options; the finite validation loader reads in the
    training process (``num_workers`` 0). Bad data or data fields raise ``ConfigError``.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"unknown data split {split!r}; expected 'train' or 'validation'")
    if split == "validation":
        loaders = build_validation_dataloaders(data, parallel_dims, tokenizer)
        if len(loaders) != 1:
            raise ValueError("build_dataloader: a validation mixture has one loader per source")
        return next(iter(loaders.values()))
    dp_rank, dp_degree = parallel_dims.data_layout() if parallel_dims is not None else (0, 1)
    try:
        if uses_sources(data.dataset):
            return _sources_dataloader(data, tokenizer, dp_rank, dp_degree)
        return _text_dataloader(
            data, data.dataset, data.dataset_path, tokenizer, dp_rank, dp_degree
        )
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        raise ConfigError(str(e)) from None


def build_validation_dataloaders(
    data: ValidationConfig, parallel_dims: ParallelDims | None, tokenizer: BaseTokenizer
) -> dict[str, SequenceDataLoader]:
    """One finite loader per validation source (one entry without a mixture), each reading
    the same sequences under every dp layout."""
    dp_rank, dp_degree, mesh = _dp_layout(parallel_dims)
    global_min = None if mesh is None else _mesh_global_min(mesh)
    try:
        if not uses_sources(data.dataset):
            loader = _text_dataloader(
                data,
                data.dataset,
                data.dataset_path,
                tokenizer,
                dp_rank,
                dp_degree,
                global_min=global_min,
                training=False,
            )
            return {data.dataset: loader}
        stores = validation_datasets(data, tokenizer, dp_rank, dp_degree)
        loaders = {}
        for config in source_configs(data):
            name = source_name(config)
            if name in stores:
                loaders[name] = SequenceDataLoader(
                    stores[name], data.local_batch_size, data.seq_len
                )
            else:
                loaders[name] = _text_dataloader(
                    data,
                    config.dataset,
                    config.dataset_path,
                    tokenizer,
                    dp_rank,
                    dp_degree,
                    global_min,
                    training=False,
                    hf=config.hf,
                )
        return loaders
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        raise ConfigError(str(e)) from None


def _text_dataloader(
    data: TrainingConfig | ValidationConfig,
    dataset: str,
    dataset_path: str | None,
    tokenizer: BaseTokenizer,
    dp_rank: int,
    dp_degree: int,
    global_min: Callable[[int], int] | None = None,
    training: bool = True,
    hf: HFDatasetConfig | None = None,
) -> SequenceDataLoader:
    """The text path: the train loader (infinite) or a validation loader (finite); ``hf``
    replaces the section's own (a mixture source's)."""
    return build_text_dataloader(
        dataset=dataset,
        dataset_path=dataset_path,
        tokenizer=tokenizer,
        seq_len=data.seq_len,
        local_batch_size=data.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        data_shards=data.data_shards,
        infinite=training,
        global_min=global_min,
        section="training" if training else "validation",
        hf=hf if hf is not None else data.hf,
        num_workers=data.dataloader.num_workers,
        persistent_workers=data.dataloader.persistent_workers,
        prefetch_factor=data.dataloader.prefetch_factor,
        pin_memory=data.dataloader.pin_memory,
    )


def _sources_dataloader(
    data: TrainingConfig, tokenizer: BaseTokenizer, dp_rank: int, dp_degree: int
) -> SequenceDataLoader:
    """The train loader of a token store or a mixture; its workers each read every
    ``num_workers``-th of the rank's samples (any number of them for stores; with a text
    source, a divisor of the rank's data shards, so that each reads whole shards)."""
    global_batch = (
        data.global_batch_size if data.global_batch_size > 0 else data.local_batch_size * dp_degree
    )
    dataset = training_dataset(data, tokenizer, dp_rank, dp_degree, global_batch)
    if dataset.text_shards_per_rank is not None:
        _check_workers(data.dataloader.num_workers, dataset.text_shards_per_rank, True, "training")
    return SequenceDataLoader(
        dataset,
        data.local_batch_size,
        data.seq_len,
        num_workers=data.dataloader.num_workers,
        persistent_workers=data.dataloader.persistent_workers,
        prefetch_factor=data.dataloader.prefetch_factor,
        pin_memory=data.dataloader.pin_memory,
    )
