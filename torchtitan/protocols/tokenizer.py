"""What the data pipeline and the models expect of a tokenizer (implementations:
``torchtitan/data/tokenizers.py``)."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod

_PROBE_TEXT = (
    "The quick brown fox; def f(x):\n\treturn x ** 2  # Grüße, 東京, émigré, naïve, 🙂 0123456789"
)


class BaseTokenizer(ABC):
    """Text <-> token ids, with optional BOS/EOS framing of each encoded text.

    ``field`` is the config field the tokenizer came from; errors name it.
    """

    field = "model.tokenizer_path"

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

    def chat_template(self) -> str:
        """Jinja2 source of the template that renders chat ``messages``; a ValueError naming
        ``field`` when the tokenizer has none."""
        raise ValueError(
            f"{self.field}: {type(self).__name__} has no chat template; use one that has"
        )

    def special_tokens(self) -> dict[str, str]:
        """The text of the special tokens a chat template refers to (``bos_token``,
        ``eos_token``)."""
        return {}

    def fingerprint(self) -> str:
        """Identifies what this tokenizer encodes to (a token store records it and refuses a
        run whose tokenizer differs): sha256 over the vocabulary size, the special ids and the
        ids of a probe text of ASCII, code, accents, CJK and an emoji. Tokenizers that can
        hash their whole vocabulary override it."""
        identity = [
            self.vocab_size,
            self.bos_id,
            self.eos_id,
            self.pad_id,
            self.encode(_PROBE_TEXT),
        ]
        return hashlib.sha256(json.dumps(identity).encode()).hexdigest()

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of text a chat template rendered: special-token texts in it become their ids;
        no BOS/EOS is added around it."""
        return self.encode(text, add_bos=False, add_eos=False)
