"""How a dataset's documents become token ids for packing."""

from __future__ import annotations

from typing import Any

from torchtitan.data.chat_template import ChatEncoder
from torchtitan.data.packing import EncodedDocument, Encoder
from torchtitan.data.registry import DatasetConfig
from torchtitan.protocols.tokenizer import BaseTokenizer


def encoding(
    config: DatasetConfig, tokenizer: BaseTokenizer, section: str
) -> tuple[Encoder, int | None]:
    """(document encoder, pad id): chat samples are packed whole, padded with the tokenizer's pad
    token, else its EOS (any id would do: padding is neither trained nor attended to)."""
    if config.chat:
        pad_id = next((i for i in (tokenizer.pad_id, tokenizer.eos_id) if i is not None), 0)
        return ChatEncoder(tokenizer, section), pad_id

    def encode_text(document: Any) -> EncodedDocument:
        return EncodedDocument(tokenizer.encode(config.text_processor(document)))

    return encode_text, None
