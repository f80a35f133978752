"""Data loaders of packed text sequences whose order does not depend on the dp layout.

See ``torchtitan/datasets/packing.py`` for the order and the state. Batches are
``({"input": LongTensor[B, seq_len], "document_ids": IntTensor[B, seq_len]}, labels LongTensor[B, seq_len])``:
``document_ids[b, p]`` numbers the documents of sample ``b`` from 0 along the sequence, so two
positions share an id exactly when they come from the same document. Labels hold
``IGNORE_INDEX`` where nothing is trained (prompt tokens and padding of chat data).

Errors in the data or its config fields reach ``build_dataloader``'s caller as ``ConfigError``
(one line, exit 2 at the entry point).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config.errors import ConfigError
from torchtitan.datasets import DatasetConfig, ShardedTextDataset, load_documents
from torchtitan.datasets.chat_template import ChatEncoder
from torchtitan.datasets.packing import EncodedDocument, Encoder, Sample

if TYPE_CHECKING:
    from torchtitan.config import JobConfig

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]

DEFAULT_DATA_SHARDS = 64


def _collate(samples: list[Sample]) -> Batch:
    inputs, labels, document_ids = zip(*samples, strict=True)
    return {"input": torch.stack(inputs), "document_ids": torch.stack(document_ids)}, torch.stack(labels)


class TextDataLoader(StatefulDataLoader):
    """A StatefulDataLoader whose state is the dataset's plain, mergeable state.

    ``state_dict()`` returns ``ShardedTextDataset.state_dict()`` (see ``merge_data_states``);
    ``load_state_dict`` accepts the rank's own state or one merged over all ranks; an empty
    state is a no-op, as for StatefulDataLoader.
    """

    def __init__(self, dataset: ShardedTextDataset, batch_size: int, **kwargs: Any) -> None:
        with warnings.catch_warnings():  # torchdata calls the deprecated torch.set_vital on every construction
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            super().__init__(dataset, batch_size=batch_size, collate_fn=_collate, num_workers=0, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.dataset.load_state_dict(state_dict)
        super().load_state_dict({})  # drops any live iterator; the next iter() resumes from the dataset


def _encoding(config: DatasetConfig, tokenizer: BaseTokenizer, section: str) -> tuple[Encoder, int | None]:
    """(document encoder, pad id): chat samples are packed whole, padded with the tokenizer's pad
    token, else its EOS (any id would do: padding is neither trained nor attended to)."""
    if config.chat:
        pad_id = next((i for i in (tokenizer.pad_id, tokenizer.eos_id) if i is not None), 0)
        return ChatEncoder(tokenizer, section), pad_id

    def encode_text(document: Any) -> EncodedDocument:
        return EncodedDocument(tokenizer.encode(config.text_processor(document)))

    return encode_text, None


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
    **dataloader_kwargs: Any,
) -> TextDataLoader:
    """A loader over dp rank ``dp_rank``'s share of the global sequence stream.

    ``global_min`` (finite loaders) reduces an int with MIN over the dp group; the default is
    the identity, right for one process. ``section`` names the config section in errors.
    Tokenization runs in the training process: ``num_workers`` must be 0.
    """
    _check_positive(section, seq_len=seq_len, local_batch_size=local_batch_size, data_shards=data_shards)
    if num_workers != 0:
        raise ValueError(
            f"{section}.dataloader.num_workers: the text dataloader keeps its state in the training "
            f"process and supports num_workers=0 only, got {num_workers}"
        )
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank {dp_rank} is outside the data-parallel degree {dp_degree}")
    if data_shards % dp_degree != 0:
        raise ValueError(
            f"{section}.data_shards ({data_shards}) must be divisible by the data-parallel degree ({dp_degree})"
        )
    config, documents = load_documents(dataset, dataset_path, section)
    encode, pad_id = _encoding(config, tokenizer, section)
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
    return TextDataLoader(text_dataset, batch_size=local_batch_size, **dataloader_kwargs)


def _dp_layout(parallel_dims: Any) -> tuple[int, int, Any]:
    """(dp rank, dp degree, dp mesh or None)."""
    if parallel_dims is None or not parallel_dims.dp_enabled:
        return 0, 1, None
    mesh = parallel_dims.world_mesh["dp"]
    return mesh.get_local_rank(), mesh.size(), mesh


def _mesh_global_min(mesh: Any) -> Callable[[int], int]:
    def global_min(value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=mesh.device_type)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=mesh.get_group())
        return int(tensor.item())

    return global_min


def build_dataloader(
    job_config: JobConfig, parallel_dims: Any, tokenizer: BaseTokenizer, split: str = "train"
) -> TextDataLoader:
    """The train loader (infinite) or the validation loader (finite) of ``job_config``.

    Each uses its section's ``dataloader`` options (``training.dataloader`` or
    ``validation.dataloader``): ``num_workers`` and ``pin_memory``. Bad data or data fields
    raise ``ConfigError``.
    """
    dp_rank, dp_degree, mesh = _dp_layout(parallel_dims)
    if split == "train":
        section, config = "training", job_config.training
        data_shards = config.data_shards
        infinite, global_min = True, None
    elif split == "validation":
        section, config = "validation", job_config.validation
        data_shards = config.data_shards
        infinite, global_min = False, None if mesh is None else _mesh_global_min(mesh)
    else:
        raise ValueError(f"unknown data split {split!r}; expected 'train' or 'validation'")
    try:
        return build_text_dataloader(
            dataset=config.dataset,
            dataset_path=config.dataset_path,
            tokenizer=tokenizer,
            seq_len=config.seq_len,
            local_batch_size=config.local_batch_size,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            data_shards=data_shards,
            infinite=infinite,
            global_min=global_min,
            num_workers=config.dataloader.num_workers,
            section=section,
            pin_memory=config.dataloader.pin_memory,
        )
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        raise ConfigError(str(e)) from None
