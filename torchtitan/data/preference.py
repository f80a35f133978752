"""Preference pairs for DPO: rows with a prompt, a chosen and a rejected completion (TRL's
column names), tokenized as TRL does and packed two documents per pair.

A row is ``{"prompt": str, "chosen": str, "rejected": str}`` (plain text) or the same three
fields as lists of chat messages (``{"role": ..., "content": ...}``; TRL's conversational
form: the prompt's turns, then the chosen and the rejected assistant turns). Tokenization
follows TRL's DPOTrainer. Plain text: the completions get the tokenizer's EOS unless they
end with it, and the prompt, the prompt + chosen and the prompt + rejected are tokenized
whole (BOS as the tokenizer adds it). Chat: the tokenizer's chat template renders the prompt
with the generation prompt, and the prompt's turns + the chosen (rejected) turns without it;
the template's end-of-turn text ends a completion (no EOS added). Either way each completion
starts where its tokens leave the prompt's (tokens may merge across the boundary).

A pair is one packing unit (``EncodedDocument`` with an inner start): a packed sequence
holds whole pairs, prompt + chosen as document ``2k``, prompt + rejected as document
``2k + 1``, then padding as one more document; only the completions' tokens carry labels,
so under document masking pairs never see or predict each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torchtitan.data.chat_template import ChatRendering
from torchtitan.data.hf_datasets import data_files
from torchtitan.data.packing import EncodedDocument
from torchtitan.data.sft import checked_messages, json_lines
from torchtitan.protocols.tokenizer import BaseTokenizer

logger = logging.getLogger("torchtitan")

FIELDS = ("prompt", "chosen", "rejected")


Messages = tuple[dict[str, str], ...]


@dataclass(frozen=True)
class PreferenceRow:
    """One checked row, plain text or chat messages in all three fields; ``source`` ("<file>
    line <n>") names it in errors."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages
    source: str

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


@dataclass(frozen=True)
class PreferencePair:
    """A row's tokens: the shared prompt and each completion after it."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]

    def sequences(self) -> tuple[list[int], list[int]]:
        """prompt + chosen and prompt + rejected."""
        return self.prompt_ids + self.chosen_ids, self.prompt_ids + self.rejected_ids


def preference_row(row: Any, source: str) -> PreferenceRow:
    """``row`` checked: an object whose ``prompt``, ``chosen`` and ``rejected`` are all
    strings or all lists of chat messages, the completions not blank. Raises ValueError
    naming the row and the field."""
    if not isinstance(row, dict):
        raise ValueError(
            f"{source}: expected a JSON object with {', '.join(FIELDS)}, got {type(row).__name__}"
        )
    for field in FIELDS:
        if field not in row:
            keys = ", ".join(map(repr, row)) or "none"
            raise ValueError(
                f"{source}: no '{field}' field (keys: {keys}); a preference row needs "
                f"{', '.join(FIELDS)}"
            )
    if isinstance(row["prompt"], list):
        return PreferenceRow(
            *(checked_messages(row[f], source, f, needs_assistant=f != "prompt") for f in FIELDS),
            source,
        )
    for field in FIELDS:
        if not isinstance(row[field], str):
            raise ValueError(
                f"{source}: '{field}' must be a string as 'prompt' is (or all three lists of "
                f"chat messages), got {type(row[field]).__name__}"
            )
    for field in ("chosen", "rejected"):
        if not row[field].strip():
            raise ValueError(f"{source}: empty '{field}'; fill it or drop the row")
    return PreferenceRow(row["prompt"], row["chosen"], row["rejected"], source)


def tokenize_pair(
    row: PreferenceRow, tokenizer: BaseTokenizer, chat: ChatRendering | None = None
) -> PreferencePair:
    """The row's tokens as TRL's DPOTrainer makes them (see the module docstring); ``chat``
    renders a conversational row (made from ``tokenizer`` where not given)."""
    if row.conversational:
        chat = chat or ChatRendering(tokenizer)
        prompt = chat.ids(row.prompt, True, row.source)
        with_chosen = chat.ids(row.prompt + row.chosen, False, row.source)
        with_rejected = chat.ids(row.prompt + row.rejected, False, row.source)
    else:
        prompt = tokenizer.encode(row.prompt, add_bos=True, add_eos=False)
        with_chosen = _with_eos(tokenizer.encode(row.prompt + row.chosen, True, False), tokenizer)
        with_rejected = _with_eos(
            tokenizer.encode(row.prompt + row.rejected, True, False), tokenizer
        )
    shared = min(_common_prefix(prompt, with_chosen), _common_prefix(prompt, with_rejected))
    return PreferencePair(prompt[:shared], with_chosen[shared:], with_rejected[shared:])


def _with_eos(ids: list[int], tokenizer: BaseTokenizer) -> list[int]:
    eos = tokenizer.eos_id
    return ids if eos is None or (ids and ids[-1] == eos) else ids + [eos]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def load_preference_files(path: str | None) -> list[PreferenceRow]:
    """Every row of the ``.jsonl`` file(s) at ``path``, checked (bad input stops the run
    before the first step with the file, the line and the field)."""
    assert path is not None  # load_documents enforces it for path datasets
    files, _ = data_files(path, "preference")
    return [preference_row(row, source) for file in files for row, source in json_lines(file)]


class PreferenceEncoder:
    """A row as one packing unit of ``window`` tokens at most: prompt + chosen, then prompt +
    rejected starting a document of its own, only the completions trained.

    A pair longer than the window keeps the start of each sequence, half a window each (TRL's
    ``keep_start`` per sequence); a pair whose prompt alone fills half a window has nothing
    left to train and is skipped (an empty unit; the count is logged once per 100)."""

    def __init__(self, tokenizer: BaseTokenizer, window: int) -> None:
        self._tokenizer = tokenizer
        self._window = window
        self._chat: ChatRendering | None = None  # made at the first conversational row
        self.skipped = 0

    def __call__(self, row: PreferenceRow) -> EncodedDocument:
        if row.conversational and self._chat is None:
            self._chat = ChatRendering(self._tokenizer)
        pair = tokenize_pair(row, self._tokenizer, self._chat)
        chosen, rejected = pair.sequences()
        prompt = len(pair.prompt_ids)
        if len(chosen) + len(rejected) > self._window:
            half = self._window // 2
            if prompt >= half:
                self._skip(row)
                return EncodedDocument([])
            chosen, rejected = chosen[:half], rejected[:half]
        targets = [k >= prompt for k in range(len(chosen))]
        targets += [k >= prompt for k in range(len(rejected))]
        return EncodedDocument(chosen + rejected, targets, (len(chosen),))

    def _skip(self, row: PreferenceRow) -> None:
        if self.skipped % 100 == 0:
            logger.warning(
                f"{row.source}: the prompt fills half a sequence, nothing of the completions "
                f"would be trained; skipped ({self.skipped + 1} pairs so far; raise "
                "training.seq_len to keep them)"
            )
        self.skipped += 1
