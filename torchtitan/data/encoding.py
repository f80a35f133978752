"""How a dataset's documents become token ids for packing."""

from __future__ import annotations

from typing import Any

from torchtitan.data.chat_template import ChatEncoder
from torchtitan.data.packing import EncodedDocument, Encoder
from torchtitan.data.preference import PreferenceEncoder
from torchtitan.data.registry import DatasetConfig
from torchtitan.protocols.tokenizer import BaseTokenizer


def encoding(
    config: DatasetConfig, tokenizer: BaseTokenizer, section: str, seq_len: int
) -> tuple[Encoder, int | None]:
    """(document encoder, pad id): chat samples and preference pairs are packed whole (a pair
    within the ``seq_len + 1`` tokens of a window), padded with the tokenizer's pad token, else
    its EOS (any id would do: padding is neither trained nor attended to)."""
    pad_id = next((i for i in (tokenizer.pad_id, tokenizer.eos_id) if i is not None), 0)
    if config.chat:
        return ChatEncoder(tokenizer, section), pad_id
    if config.preference:
        return PreferenceEncoder(tokenizer, seq_len + 1), pad_id

    def encode_text(document: Any) -> EncodedDocument:
        return EncodedDocument(tokenizer.encode(config.text_processor(document)))

    return encode_text, None
