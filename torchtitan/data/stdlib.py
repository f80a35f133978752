"""The embedded default corpus: the running interpreter's Python standard library source.

It needs no download: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` in sorted
relative-path order, without test code (any directory named ``test``, ``tests`` or
``idle_test``, any file named ``test_*``) and without ``site-packages``/``dist-packages``.
Every 10th file of that order (indices 0, 10, 20, ...) is the validation split; the others
are the train split. A document is one file's text, read lazily with ``errors="replace"``.

The corpus depends on the interpreter version; ``corpus_fingerprint`` identifies it in logs.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import overload

logger = logging.getLogger("torchtitan")

VALIDATION_EVERY = 10
SPLITS = ("train", "validation")
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_INSTALL_DIRS = frozenset({"site-packages", "dist-packages"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_corpus_file(relative: Path) -> bool:
    *dirs, name = relative.parts
    if any(d in _TEST_DIRS or d in _INSTALL_DIRS for d in dirs):
        return False
    return not name.startswith("test_")


@functools.cache
def _all_files() -> tuple[str, ...]:
    """The corpus files, sorted. Excluded directories are pruned while walking: the stdlib
    folder of a pyenv or system Python often holds a site-packages ten times its size."""
    root = stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _TEST_DIRS and d not in _INSTALL_DIRS]
        for name in files:
            path = Path(folder, name)
            if name.endswith(".py") and path.is_file():
                relative = path.relative_to(root)
                if _is_corpus_file(relative):
                    found.append(relative.as_posix())
    return tuple(sorted(found))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown python_stdlib split {split!r}; expected one of {SPLITS}")


@functools.cache
def split_files(split: str) -> tuple[str, ...]:
    """Relative paths (posix) of the split's files, in corpus order."""
    _check_split(split)
    want_validation = split == "validation"
    return tuple(
        f for i, f in enumerate(_all_files()) if (i % VALIDATION_EVERY == 0) == want_validation
    )


@functools.cache
def corpus_fingerprint(split: str) -> str:
    """Short sha1 over the split's relative paths and file sizes."""
    root = stdlib_root()
    digest = hashlib.sha1()
    for relative in split_files(split):
        digest.update(f"{relative}\t{(root / relative).stat().st_size}\n".encode())
    return digest.hexdigest()[:12]


class StdlibCorpus(Sequence[str]):
    """The split's files as a lazily read sequence of texts."""

    def __init__(self, split: str) -> None:
        self._root = stdlib_root()
        self._files = split_files(split)

    def __len__(self) -> int:
        return len(self._files)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return (self._root / self._files[index]).read_text(encoding="utf-8", errors="replace")


@functools.cache
def _log_corpus(split: str) -> None:
    logger.info(
        "python_stdlib %s split: %d files from %s, corpus fingerprint %s",
        split,
        len(split_files(split)),
        stdlib_root(),
        corpus_fingerprint(split),
    )


def load_stdlib(split: str) -> StdlibCorpus:
    corpus = StdlibCorpus(split)
    if len(corpus) == 0:
        raise ValueError(f"no Python source files found under {stdlib_root()}")
    _log_corpus(split)
    return corpus
