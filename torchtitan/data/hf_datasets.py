"""Datasets read through HuggingFace ``datasets`` (imported only when one of them is loaded).

- ``c4`` / ``c4_validation``: allenai/c4 (en), streamed from the Hub; needs internet.
- ``json`` / ``jsonl`` / ``parquet``: local files at ``dataset_path`` (a file, or a directory
  searched recursively in sorted path order), one document per row, text in column ``"text"``.
  ``.json.gz``/``.jsonl.gz`` work too, so a local copy of c4 loads as ``json``.
- ``txt``: local text at ``dataset_path``. A directory: every ``*.txt`` file below it (sorted)
  is one document. A single file: every non-blank line is one document.

Local files are loaded non-streaming (Arrow-backed, memory-mapped), so documents are indexable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEXT_COLUMN = "text"
_SUFFIXES = {
    "json": (".json", ".jsonl", ".json.gz", ".jsonl.gz"),
    "parquet": (".parquet",),
    "txt": (".txt",),
    "sft": (".jsonl",),
    "preference": (".jsonl",),
    "prompts": (".jsonl",),
}


def row_text(row: dict[str, Any]) -> str:
    return row[TEXT_COLUMN] or ""


def load_c4(split: str) -> Any:
    import datasets

    return datasets.load_dataset("allenai/c4", name="en", split=split, streaming=True)


def data_files(path: str, kind: str) -> tuple[list[str], bool]:
    """(sorted data files, whether ``path`` is a directory) for a file or directory path."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{path!r} does not exist")
    if root.is_file():
        return [str(root)], False
    suffixes = _SUFFIXES[kind]
    files = sorted(str(p) for p in root.rglob("*") if p.is_file() and p.name.endswith(suffixes))
    if not files:
        raise FileNotFoundError(f"{path!r} contains no files ending in {', '.join(suffixes)}")
    return files, True


def _check_not_empty(path: str, files: list[str]) -> None:
    if all(Path(f).stat().st_size == 0 for f in files):
        raise ValueError(f"dataset has no documents: the data files at {path!r} are empty")


def _load_local(builder: str, files: list[str], **kwargs: Any) -> Any:
    import datasets

    try:
        return datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
    except Exception as e:  # malformed or empty files surface as assorted library errors
        where = f"{files[0]}{', ...' if len(files) > 1 else ''}"
        raise ValueError(f"cannot read {builder} files ({where}): {explain_error(e)}") from None


def explain_error(error: BaseException) -> str:
    """The error and its root cause in one line (the library wraps parse errors)."""
    parts = []
    while error is not None:
        parts.append(str(error) or type(error).__name__)
        error = error.__cause__
    return ": ".join(parts)


def load_table_files(path: str | None, kind: str) -> Any:
    """json/jsonl/parquet rows restricted to the text column."""
    assert path is not None  # load_documents enforces it for path datasets
    files, _ = data_files(path, kind)
    _check_not_empty(path, files)
    table = _load_local(kind, files)
    if TEXT_COLUMN not in table.column_names:
        raise ValueError(
            f"{path!r} has no {TEXT_COLUMN!r} column (columns: {', '.join(table.column_names)})"
        )
    return table.select_columns([TEXT_COLUMN])


def _keep_non_blank(texts: list[str]) -> list[bool]:
    return [bool(t.strip()) for t in texts]


def load_text_files(path: str | None) -> Any:
    assert path is not None
    files, is_directory = data_files(path, "txt")
    _check_not_empty(path, files)
    if is_directory:
        return _load_local("text", files, sample_by="document")
    lines = _load_local("text", files, sample_by="line")
    return lines.filter(_keep_non_blank, input_columns=TEXT_COLUMN, batched=True)
