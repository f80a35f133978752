"""Loaders over token stores and data mixtures: ``dataset = "tokens"`` (one store at
``dataset_path``) and ``dataset = "mixture"`` (the ``dataset_mixture`` sources), for training
(an endless blended stream, ``torchtitan/data/mixture.py``) and validation (each source on
its own, one pass)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan.config import DataSourceConfig
from torchtitan.config.errors import ConfigError
from torchtitan.data import ShardedTextDataset, load_documents
from torchtitan.data.encoding import encoding
from torchtitan.data.mixture import (
    MixedDataset,
    Source,
    StoreSource,
    TextSource,
    Weighted,
    shuffle_for,
)
from torchtitan.data.store_packing import FiniteStoreDataset, StoreSequences
from torchtitan.data.token_store import StoreError, TokenStore
from torchtitan.protocols.tokenizer import BaseTokenizer

if TYPE_CHECKING:
    from torchtitan.config import TrainingConfig, ValidationConfig

TOKENS, MIXTURE = "tokens", "mixture"


def uses_sources(dataset: str) -> bool:
    return dataset in (TOKENS, MIXTURE)


def source_configs(data: TrainingConfig | ValidationConfig) -> list[DataSourceConfig]:
    """The sources of a section: its mixture, or its one token store."""
    if data.dataset == MIXTURE:
        return list(data.dataset_mixture)
    return [DataSourceConfig(dataset=TOKENS, dataset_path=data.dataset_path)]


def source_name(config: DataSourceConfig) -> str:
    if config.name:
        return config.name
    return Path(config.dataset_path).name if config.dataset_path else config.dataset


def open_store(path: str | None, tokenizer: BaseTokenizer, field: str) -> TokenStore:
    """The store at ``path``, refused (one line naming ``field``) when it cannot be read or
    was made with another tokenizer than this run's."""
    if not path:
        raise ConfigError(f"{field}: a token store needs its folder (dataset_path)")
    try:
        store = TokenStore(path)
    except (StoreError, OSError) as e:
        raise ConfigError(f"{field}: {e}") from None
    made_with = store.manifest.tokenizer
    if made_with.get("fingerprint") != tokenizer.fingerprint():
        raise ConfigError(
            f"{field}: the token store {path} was made with another tokenizer "
            f"({made_with.get('path')!r}, vocabulary {made_with.get('vocab_size')}) than this "
            f"run's (vocabulary {tokenizer.vocab_size}, model.tokenizer_path); prepare the "
            "store with this tokenizer or train with that one"
        )
    return store


def _field(section: str, index: int | None) -> str:
    return f"{section}.dataset_path" if index is None else f"{section}.dataset_mixture[{index}]"


def _source(
    config: DataSourceConfig,
    index: int | None,
    data: Any,
    tokenizer: BaseTokenizer,
    dp_rank: int,
    dp_degree: int,
) -> Source:
    """One training source: a store (shuffled when ``shuffle_seed`` is set) or a text stream
    (this rank's data shards of it)."""
    section = "training"
    name, field = source_name(config), _field(section, index)
    if config.dataset == TOKENS:
        store = open_store(config.dataset_path, tokenizer, field)
        sequences = StoreSequences(store, data.data_shards, data.seq_len)
        shuffle = shuffle_for(
            data.shuffle_seed, data.shuffle_window, sequences.sequences_per_epoch, name
        )
        return StoreSource(name, sequences, shuffle)
    if data.shuffle_seed is not None:
        raise ConfigError(
            f"{section}.shuffle_seed: source {name!r} is a text dataset, which cannot be read "
            "out of order; prepare it into a token store (python scripts/data/prepare.py)"
        )
    dataset_config, documents = load_documents(
        config.dataset, config.dataset_path, section, config.hf
    )
    encode, pad_id = encoding(dataset_config, tokenizer, section, data.seq_len)
    stream = ShardedTextDataset(
        name=config.dataset,
        documents=documents,
        encode=encode,
        seq_len=data.seq_len,
        dp_rank=0,
        dp_degree=1,
        data_shards=data.data_shards,
        infinite=True,
        pad_id=pad_id,
        section=section,
    )
    return TextSource(name, stream, dp_rank, dp_degree)


def training_dataset(
    data: TrainingConfig, tokenizer: BaseTokenizer, dp_rank: int, dp_degree: int, global_batch: int
) -> MixedDataset:
    """The rank's endless blended stream of the ``[training]`` sources."""
    configs = source_configs(data)
    indexed = [(c, i if data.dataset == MIXTURE else None) for i, c in enumerate(configs)]
    sources = [
        Weighted(_source(c, i, data, tokenizer, dp_rank, dp_degree), c.weight, c.max_epochs)
        for c, i in indexed
    ]
    return MixedDataset(sources, global_batch, dp_rank, dp_degree)


def validation_datasets(
    data: ValidationConfig, tokenizer: BaseTokenizer, dp_rank: int, dp_degree: int
) -> dict[str, Any]:
    """Per source, the rank's share of one pass over it (stores; text sources come from the
    text loader builder, which the caller uses for them)."""
    datasets = {}
    for index, config in enumerate(source_configs(data)):
        if config.dataset != TOKENS:
            continue
        field = _field("validation", index if data.dataset == MIXTURE else None)
        store = open_store(config.dataset_path, tokenizer, field)
        sequences = StoreSequences(store, data.data_shards, data.seq_len)
        datasets[source_name(config)] = FiniteStoreDataset(sequences, dp_rank, dp_degree)
    return datasets
