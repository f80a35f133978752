"""Text datasets: a registry of named document collections, the embedded stdlib corpus,
HuggingFace-backed datasets, and dp-layout-independent packing/sharding.

Built-in datasets: ``python_stdlib`` / ``python_stdlib_validation`` (embedded, no download),
``c4`` / ``c4_validation`` (needs internet), ``json``, ``jsonl``, ``parquet``, ``txt`` (local
files at ``dataset_path``), ``sft`` / ``chat`` (chat fine-tuning samples in local jsonl),
``tokens`` (a token store at ``dataset_path``, made by ``scripts/data/prepare.py``),
``hf`` (any Hugging Face dataset: a hub id or local folder at ``dataset_path``, see
``hf_source.py``).
"""

from functools import partial

from torchtitan.data import hf_datasets as hf
from torchtitan.data import preference, prompts, sft, stdlib
from torchtitan.data.hf_source import load_hf_documents
from torchtitan.data.packing import ShardCursor, ShardedTextDataset
from torchtitan.data.registry import (
    DatasetConfig,
    Documents,
    get_dataset_config,
    load_documents,
    register_dataset,
    registered_datasets,
)
from torchtitan.data.state import merge_data_states
from torchtitan.data.stdlib import corpus_fingerprint

__all__ = [
    "DatasetConfig",
    "Documents",
    "ShardCursor",
    "ShardedTextDataset",
    "corpus_fingerprint",
    "get_dataset_config",
    "load_documents",
    "merge_data_states",
    "register_dataset",
    "registered_datasets",
]


def _read_as_a_store(path: str | None) -> Documents:
    raise ValueError("the tokens dataset is a token store, read by position, not as documents")


def _register_builtins() -> None:
    for name, split in (("python_stdlib", "train"), ("python_stdlib_validation", "validation")):
        register_dataset(
            name, DatasetConfig(name, lambda path, split=split: stdlib.load_stdlib(split))
        )
    for name, split in (("c4", "train"), ("c4_validation", "validation")):
        register_dataset(
            name, DatasetConfig(name, lambda path, split=split: hf.load_c4(split), hf.row_text)
        )
    for name in ("json", "jsonl"):
        register_dataset(
            name, DatasetConfig(name, partial(hf.load_table_files, kind="json"), hf.row_text, True)
        )
    parquet = partial(hf.load_table_files, kind="parquet")
    register_dataset("parquet", DatasetConfig("parquet", parquet, hf.row_text, True))
    register_dataset("txt", DatasetConfig("txt", hf.load_text_files, hf.row_text, True))
    register_dataset("hf", DatasetConfig("hf", load_hf_documents, uses_path=True, hf_options=True))
    register_dataset("tokens", DatasetConfig("tokens", _read_as_a_store, uses_path=True))
    for name in ("sft", "chat"):
        register_dataset(name, DatasetConfig(name, sft.load_sft_files, uses_path=True, chat=True))
    register_dataset(
        "prompts", DatasetConfig("prompts", prompts.load_prompt_files, uses_path=True, prompts=True)
    )
    register_dataset(
        "preference",
        DatasetConfig(
            "preference", preference.load_preference_files, uses_path=True, preference=True
        ),
    )


_register_builtins()
