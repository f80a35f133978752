"""Tokenizers: a file-free byte tokenizer and a wrapper around HuggingFace ``tokenizer.json``."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchtitan.config import JobConfig


class BaseTokenizer(ABC):
    """Text <-> token ids, with optional BOS/EOS framing of each encoded text."""

    @abstractmethod
    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def bos_id(self) -> int | None: ...

    @property
    @abstractmethod
    def eos_id(self) -> int | None: ...

    @property
    @abstractmethod
    def pad_id(self) -> int | None: ...


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258.

    Ids 259..263 are reserved and never produced: they round the vocabulary up to 264,
    a multiple of 8, which tensor-parallel vocabulary sharding wants.
    """

    _BOS, _EOS, _PAD = 256, 257, 258
    _VOCAB_SIZE = 264

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self._BOS)
        if add_eos:
            ids.append(self._EOS)
        return ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return self._VOCAB_SIZE

    @property
    def bos_id(self) -> int:
        return self._BOS

    @property
    def eos_id(self) -> int:
        return self._EOS

    @property
    def pad_id(self) -> int:
        return self._PAD


class HuggingFaceTokenizer(BaseTokenizer):
    """A ``tokenizers`` tokenizer loaded from ``tokenizer.json``.

    BOS/EOS come from ``tokenizer_config.json`` (``bos_token``/``eos_token``, plain strings or
    dicts with ``"content"``); when it does not name them, they are inferred from the special
    tokens the tokenizer's post-processor puts around a text. Encoding always bypasses the
    post-processor and adds BOS/EOS itself, so a post-processor that adds BOS never leads to a
    doubled BOS.

    ``field`` is the config field the path came from; it is named in errors.
    """

    def __init__(self, path: str | Path, field: str = "model.tokenizer_path") -> None:
        from tokenizers import Tokenizer

        tokenizer_file, config_file = _locate_tokenizer_files(Path(path), field)
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ValueError(f"{field}: cannot load {tokenizer_file}: {e}") from None
        config = _read_tokenizer_config(config_file, field)
        inferred_bos, inferred_eos = self._post_processor_specials()
        self._bos = self._special_id(config, "bos_token", field, inferred_bos)
        self._eos = self._special_id(config, "eos_token", field, inferred_eos)
        self._pad = self._special_id(config, "pad_token", field, None)

    def _special_id(self, config: dict[str, Any], key: str, field: str, default: int | None) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token is None:
            return default
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field}: tokenizer_config.json names {key} {token!r}, which is not in tokenizer.json")
        return token_id

    def _post_processor_specials(self) -> tuple[int | None, int | None]:
        """(bos, eos) ids the post-processor adds around the text "a", or None where it adds none."""
        plain = self._tokenizer.encode("a", add_special_tokens=False).ids
        framed = self._tokenizer.encode("a", add_special_tokens=True).ids
        if not plain or len(framed) <= len(plain):
            return None, None
        bos = framed[0] if framed[0] != plain[0] else None
        eos = framed[-1] if framed[-1] != plain[-1] else None
        return bos, eos

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos and self._bos is not None:
            ids.insert(0, self._bos)
        if add_eos and self._eos is not None:
            ids.append(self._eos)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def pad_id(self) -> int | None:
        return self._pad


def _locate_tokenizer_files(path: Path, field: str) -> tuple[Path, Path | None]:
    """(tokenizer.json, tokenizer_config.json or None) for a directory or a direct file path."""
    if not path.exists():
        raise FileNotFoundError(
            f"{field}: {str(path)!r} does not exist (expected a directory containing tokenizer.json, "
            f"or the path of a tokenizer.json file)"
        )
    tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{field}: {str(path)!r} has no tokenizer.json (expected {tokenizer_file})")
    config_file = tokenizer_file.parent / "tokenizer_config.json"
    return tokenizer_file, config_file if config_file.is_file() else None


def _read_tokenizer_config(config_file: Path | None, field: str) -> dict[str, Any]:
    if config_file is None:
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}: cannot read {config_file}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{field}: {config_file} must hold a JSON object")
    return config


def build_tokenizer(job_config: JobConfig) -> BaseTokenizer:
    """``model.tokenizer_path`` if set, else ``model.hf_assets_path``, else the byte tokenizer.

    ``model.tokenizer_path = "byte"`` selects the byte tokenizer explicitly.
    """
    tokenizer_path = getattr(job_config.model, "tokenizer_path", None)
    if tokenizer_path == "byte":
        return ByteTokenizer()
    if tokenizer_path:
        return HuggingFaceTokenizer(tokenizer_path, field="model.tokenizer_path")
    hf_assets_path = getattr(job_config.model, "hf_assets_path", None)
    if hf_assets_path:
        return HuggingFaceTokenizer(hf_assets_path, field="model.hf_assets_path")
    return ByteTokenizer()
