"""Registry of text datasets by name.

A dataset's loader returns its documents in a fixed order, in one of two forms:

- indexable: anything with ``__len__`` and ``__getitem__(int)`` (a list, a lazy sequence, an
  Arrow-backed HuggingFace ``Dataset``); document ``i`` is ``docs[i]``;
- streamed: a re-iterable (every ``iter()`` starts again at the first document, like a streaming
  HuggingFace ``IterableDataset``); document ``i`` is the ``i``-th one iterated.

``text_processor`` turns one raw document (a row dict, say) into its text. Chat datasets
(``chat=True``) hold ``ChatSample``s instead, rendered with the tokenizer's chat template.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

from torchtitan.tools.storage import is_url

Documents: TypeAlias = Sequence[Any] | Iterable[Any]


def _identity(document: Any) -> str:
    return document


@dataclass(frozen=True)
class DatasetConfig:
    """How to load one named dataset.

    ``uses_path``: the loader reads the config's ``dataset_path`` (required then); datasets that
    do not use it reject a set path rather than silently ignore it.
    ``chat``: the documents are chat samples (``torchtitan.data.sft.ChatSample``): only
    their assistant turns are trained, and each is packed whole into a sequence.
    ``preference``: the documents are preference rows (``torchtitan.data.preference``), each
    packed whole as two documents (prompt + chosen, prompt + rejected) for DPO.
    ``prompts``: the documents are GRPO's prompts (``torchtitan.data.prompts``), never packed:
    the rollouts are what trains.
    ``hf_options``: the loader also takes the section's ``HFDatasetConfig`` and section name
    (``loader(path, options, section)``), and the documents say whether they are chat.
    """

    name: str
    loader: Callable[[str | None], Documents]
    text_processor: Callable[[Any], str] = _identity
    uses_path: bool = False
    chat: bool = False
    preference: bool = False
    prompts: bool = False
    hf_options: bool = False


_DATASETS: dict[str, DatasetConfig] = {}


def register_dataset(name: str, config: DatasetConfig) -> None:
    """Register ``config`` under ``name``; registering a name again replaces the earlier entry."""
    _DATASETS[name] = config


def registered_datasets() -> list[str]:
    return sorted(_DATASETS)


def get_dataset_config(name: str, section: str = "training") -> DatasetConfig:
    if name not in _DATASETS:
        raise ValueError(
            f"{section}.dataset: unknown dataset {name!r}; registered datasets: "
            f"{', '.join(registered_datasets())}"
        )
    return _DATASETS[name]


def is_indexable(documents: Documents) -> bool:
    return hasattr(documents, "__len__") and hasattr(documents, "__getitem__")


def check_dataset_fields(name: str, path: str | None, section: str = "training") -> DatasetConfig:
    """The config of dataset ``name`` after the checks that read no data (so the one-process
    check before launch can run them): the name is registered, and ``dataset_path`` is set
    exactly when the dataset reads local files, and exists then."""
    config = get_dataset_config(name, section)
    if config.uses_path and not path:
        raise ValueError(
            f"{section}.dataset_path: dataset {name!r} reads local files; "
            f"set {section}.dataset_path"
        )
    if path and not config.uses_path:
        raise ValueError(
            f"{section}.dataset_path: dataset {name!r} does not read a path (got {path!r}); "
            f"unset it, or use one of the file datasets json, jsonl, parquet, txt, sft"
        )
    if path and is_url(path):
        if name != "tokens":
            raise ValueError(
                f"{section}.dataset_path: {path} is a URL; of the datasets only token stores "
                "(dataset tokens) read from object storage: prepare one there"
            )
        return config
    if path and not os.path.exists(path) and (not config.hf_options or _names_a_file(path)):
        raise FileNotFoundError(f"{section}.dataset_path: {path!r} does not exist")
    return config


def _names_a_file(path: str) -> bool:
    """Whether a path cannot be a hub id (``org/name``): absolute, home- or dot-relative."""
    return path.startswith(("/", "~", "."))


def load_documents(
    name: str, path: str | None, section: str = "training", hf: Any = None
) -> tuple[DatasetConfig, Documents]:
    """Look up ``name`` and run its loader, turning loader failures into one error naming the field.

    ``hf`` (an ``HFDatasetConfig``; defaults when None) goes to loaders that take it.
    Loaders raise FileNotFoundError / ValueError / ConnectionError with plain messages; this
    prefixes the config field (``<section>.dataset_path`` for path-based datasets, else
    ``<section>.dataset``) and drops the library traceback.
    """
    config = check_dataset_fields(name, path, section)
    if config.hf_options:
        return _load_with_options(config, path, section, hf)
    field = f"{section}.dataset_path" if config.uses_path else f"{section}.dataset"
    try:
        documents = config.loader(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{field}: {e}") from None
    except ConnectionError as e:
        raise ConnectionError(
            f"{field}: cannot reach dataset {name!r} ({e}); without internet use the embedded "
            f"'python_stdlib' dataset or local files via {section}.dataset_path"
        ) from None
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    if is_indexable(documents) and len(documents) == 0:
        raise ValueError(f"{field}: dataset {name!r} has no documents")
    return config, documents


def _load_with_options(
    config: DatasetConfig, path: str | None, section: str, hf: Any
) -> tuple[DatasetConfig, Documents]:
    """A loader whose errors already name their field (``section.hf.*``, ``dataset_path``)."""
    if hf is None:
        from torchtitan.config import HFDatasetConfig

        hf = HFDatasetConfig()
    documents = config.loader(path, hf, section)
    return replace(config, chat=documents.chat), documents
