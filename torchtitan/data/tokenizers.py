"""Tokenizers: a file-free byte tokenizer and a wrapper around HuggingFace ``tokenizer.json``.

Both carry a chat template (Jinja2 source, rendered in a sandbox by ``torchtitan.data``)
for fine-tuning on chat data: the byte tokenizer a small built-in one, a HuggingFace tokenizer
the one it ships (``chat_template.jinja``, else ``chat_template`` in ``tokenizer_config.json``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan.protocols.tokenizer import BaseTokenizer

if TYPE_CHECKING:
    from tokenizers import AddedToken, Tokenizer

    from torchtitan.config import ModelConfig


_BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258.

    Ids 259..263 are reserved and never produced: they round the vocabulary up to 264,
    a multiple of 8, which tensor-parallel vocabulary sharding wants.

    Chat template: ``<|role|>`` and a newline before each message's content, EOS after an assistant
    message, a newline after any other; BOS first. ``encode`` never produces BOS/EOS from text;
    only ``encode_rendered`` reads ``<|bos|>``/``<|eos|>`` in rendered chat text as BOS/EOS.
    """

    _BOS, _EOS, _PAD = 256, 257, 258
    _VOCAB_SIZE = 264
    _SPECIAL_TEXT = {"<|bos|>": _BOS, "<|eos|>": _EOS}
    _SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(text) for text in _SPECIAL_TEXT) + ")")

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self._BOS)
        if add_eos:
            ids.append(self._EOS)
        return ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def chat_template(self) -> str:
        return _BYTE_CHAT_TEMPLATE

    def special_tokens(self) -> dict[str, str]:
        return {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}

    def encode_rendered(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._SPECIAL_SPLIT.split(text):
            special = self._SPECIAL_TEXT.get(part)
            ids.extend([special] if special is not None else part.encode("utf-8"))
        return ids

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
    """A ``tokenizers`` tokenizer loaded from ``tokenizer.json``, completed by
    ``tokenizer_config.json``.

    Tokens the config names that tokenizer.json lacks (``added_tokens_decoder`` entries, the
    ``bos_token``/``eos_token``/``pad_token``/... it names) are added with the ids transformers'
    loader gives them: appended after the vocabulary in that order (see ``_add_config_tokens``).
    BOS/EOS come from ``tokenizer_config.json`` (``bos_token``/``eos_token``, plain strings or
    dicts with ``"content"``); when it does not name them, they are inferred from the special
    tokens the tokenizer's post-processor puts around a text. Encoding always bypasses the
    post-processor and adds BOS/EOS itself, so a post-processor that adds BOS never leads to a
    doubled BOS. Special tokens written in a text (``<|im_start|>``, say) encode to their ids.

    ``field`` is the config field the path came from; it is named in errors.
    """

    def __init__(self, path: str | Path, field: str = "model.tokenizer_path") -> None:
        from tokenizers import Tokenizer

        self.field = field
        tokenizer_file, config_file = _locate_tokenizer_files(Path(path), field)
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ValueError(f"{field}: cannot load {tokenizer_file}: {e}") from None
        config = _read_tokenizer_config(config_file, field)
        _add_config_tokens(self._tokenizer, config, field)
        inferred_bos, inferred_eos = self._post_processor_specials()
        self._bos = self._special_id(config, "bos_token", field, inferred_bos)
        self._eos = self._special_id(config, "eos_token", field, inferred_eos)
        self._pad = self._special_id(config, "pad_token", field, None)
        self._folder = tokenizer_file.parent
        self._chat_template = _find_chat_template(self._folder, config, field)

    def _special_id(
        self, config: dict[str, Any], key: str, field: str, default: int | None
    ) -> int | None:
        token = _token_content(config.get(key), key, field)
        return default if token is None else self._tokenizer.token_to_id(token)

    def _post_processor_specials(self) -> tuple[int | None, int | None]:
        """(bos, eos) ids the post-processor adds around the text "a", or None where it adds
        none."""
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

    def chat_template(self) -> str:
        if self._chat_template is None:
            raise ValueError(
                f"{self.field}: the tokenizer in {self._folder} has no chat template "
                "(no chat_template.jinja, no chat_template in tokenizer_config.json); "
                "chat data needs one: add it there or use a tokenizer that ships one"
            )
        return self._chat_template

    def special_tokens(self) -> dict[str, str]:
        ids = {"bos_token": self._bos, "eos_token": self._eos, "pad_token": self._pad}
        return {name: self._tokenizer.id_to_token(i) for name, i in ids.items() if i is not None}

    def fingerprint(self) -> str:
        """sha256 over the whole tokenizer (vocabulary, merges, added tokens) and BOS/EOS/PAD."""
        specials = json.dumps([self._bos, self._eos, self._pad])
        return hashlib.sha256((self._tokenizer.to_str() + specials).encode()).hexdigest()

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
            f"{field}: {str(path)!r} does not exist (expected a directory containing "
            "tokenizer.json, or the path of a tokenizer.json file)"
        )
    tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
    if not tokenizer_file.is_file():
        raise FileNotFoundError(
            f"{field}: {str(path)!r} has no tokenizer.json (expected {tokenizer_file})"
        )
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


_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The special tokens tokenizer_config.json names, in the order transformers adds them."""


def _token_content(token: Any, key: str, field: str) -> str | None:
    """A config token's text: a plain string, or a dict with ``"content"``."""
    if isinstance(token, dict):
        token = token.get("content")
    if token is not None and not isinstance(token, str):
        raise ValueError(
            f'{field}: {key} in tokenizer_config.json must be a string or a dict with "content"'
        )
    return token


def _config_tokens(config: dict[str, Any], field: str) -> list[AddedToken]:
    """The tokens tokenizer_config.json declares, in the order transformers' loader adds them:
    ``added_tokens_decoder`` by ascending listed id, then the named special tokens, then
    ``additional_special_tokens``."""
    from tokenizers import AddedToken

    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict) or not all(
        str(k).isdigit() and isinstance(v, dict) and "content" in v for k, v in decoder.items()
    ):
        raise ValueError(
            f"{field}: added_tokens_decoder in tokenizer_config.json must map ids to dicts "
            'with "content"'
        )
    tokens = []
    for _, entry in sorted(decoder.items(), key=lambda item: int(item[0])):
        content = _token_content(entry, "added_tokens_decoder", field)
        special = bool(entry.get("special", False))
        flags = {name: bool(entry.get(name, False)) for name in ("single_word", "lstrip", "rstrip")}
        tokens.append(
            AddedToken(
                content,
                **flags,
                normalized=bool(entry.get("normalized", not special)),
                special=special,
            )
        )
    named = [(key, config.get(key)) for key in _NAMED_SPECIAL_TOKENS]
    named += [
        ("additional_special_tokens", token)
        for token in config.get("additional_special_tokens") or []
    ]
    for key, token in named:
        content = _token_content(token, key, field)
        if content is not None:
            tokens.append(AddedToken(content, normalized=False, special=True))
    return tokens


def _add_config_tokens(tokenizer: Tokenizer, config: dict[str, Any], field: str) -> None:
    """Add the config's tokens that are not yet added tokens of ``tokenizer``, one by one, so each
    takes the next free id (a token already in the vocabulary keeps its id)."""
    present = {added.content for added in tokenizer.get_added_tokens_decoder().values()}
    for token in _config_tokens(config, field):
        if token.content in present:
            continue
        present.add(token.content)
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])


def _find_chat_template(folder: Path, config: dict[str, Any], field: str) -> str | None:
    """``chat_template.jinja`` next to tokenizer.json, else the config's ``chat_template``: a
    string, or a list of ``{"name", "template"}`` of which the one named ``default`` is used."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(
        f"{field}: chat_template in tokenizer_config.json must be a string or a list of "
        f'{{"name", "template"}} with one named "default"'
    )


def build_tokenizer(model: ModelConfig) -> BaseTokenizer:
    """``model.tokenizer_path`` if set, else ``model.hf_assets_path``, else the byte tokenizer.

    ``model.tokenizer_path = "byte"`` selects the byte tokenizer explicitly.
    """
    tokenizer_path = getattr(model, "tokenizer_path", None)
    if tokenizer_path == "byte":
        return ByteTokenizer()
    if tokenizer_path:
        return HuggingFaceTokenizer(tokenizer_path, field="model.tokenizer_path")
    hf_assets_path = getattr(model, "hf_assets_path", None)
    if hf_assets_path:
        return HuggingFaceTokenizer(hf_assets_path, field="model.hf_assets_path")
    return ByteTokenizer()
