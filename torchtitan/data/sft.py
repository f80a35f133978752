"""Chat / instruction fine-tuning data (``training.dataset = "sft"`` or ``"chat"``).

``dataset_path`` is a ``.jsonl`` file, or a directory searched recursively for them (sorted
path order). Every non-blank line is one sample, either

- ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``, or
- ``{"prompt": str, "completion": str}`` (a user message and the assistant's answer).

All lines are read and checked when the dataset loads, so bad input stops the run before the
first step with one error naming the file, the line and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torchtitan.data.hf_datasets import data_files

ROLES = ("system", "user", "assistant")
_FORMATS = (
    '{"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "completion": ...}'
)


@dataclass(frozen=True)
class ChatSample:
    """One conversation; ``source`` ("<file> line <n>") names it in errors."""

    messages: tuple[dict[str, str], ...]
    source: str


def load_sft_files(path: str | None) -> list[ChatSample]:
    assert path is not None  # load_documents enforces it for path datasets
    files, _ = data_files(path, "sft")
    return [sample for file in files for sample in _read_file(file)]


def _read_file(file: str) -> Iterator[ChatSample]:
    for row, source in json_lines(file):
        yield ChatSample(_messages(row, source), source)


def json_lines(file: str) -> Iterator[tuple[Any, str]]:
    """Each non-blank line of a ``.jsonl`` file parsed, with its source ("<file> line <n>");
    a line that is not UTF-8 JSON raises ValueError naming it."""
    with open(file, "rb") as f:
        for number, raw in enumerate(f, 1):
            source = f"{file} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{source}: not UTF-8 text") from None
            if line.strip():
                yield _parse(line.rstrip(), source), source


def _parse(line: str, source: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{source}: invalid JSON ({e.msg} at column {e.colno}); write one JSON object per line"
        ) from None


def _messages(row: Any, source: str) -> tuple[dict[str, str], ...]:
    if not isinstance(row, dict):
        raise ValueError(
            f"{source}: expected a JSON object, got {type(row).__name__}; write {_FORMATS}"
        )
    if "messages" in row:
        return checked_messages(row["messages"], source)
    if "prompt" in row or "completion" in row:
        return _prompt_completion(row, source)
    keys = ", ".join(map(repr, row)) or "none"
    raise ValueError(
        f"{source}: no 'messages' or 'prompt'/'completion' field (keys: {keys}); write {_FORMATS}"
    )


def checked_messages(
    messages: Any, source: str, field: str = "messages", needs_assistant: bool = True
) -> tuple[dict[str, str], ...]:
    """``messages`` (the row's ``field``) as chat messages; with ``needs_assistant`` at least
    one assistant turn (what is trained). Raises ValueError naming the row and the field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f'{source}: \'{field}\' must be a non-empty list of {{"role": ..., "content": ...}}'
        )
    for k, message in enumerate(messages):
        if not _is_message(message):
            raise ValueError(
                f'{source}: {field}[{k}] must be {{"role": one of {", ".join(ROLES)}, '
                f'"content": a string}}, got {json.dumps(message)[:80]}'
            )
        if message["role"] == "assistant" and not message["content"].strip():
            raise ValueError(
                f"{source}: {field}[{k}] is an assistant message with empty 'content'; "
                "fill it or drop it"
            )
    if needs_assistant and not any(message["role"] == "assistant" for message in messages):
        raise ValueError(
            f"{source}: '{field}' has no assistant message, so nothing would be trained; add one"
        )
    return tuple({"role": message["role"], "content": message["content"]} for message in messages)


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and message.get("role") in ROLES
        and isinstance(message.get("content"), str)
    )


def _prompt_completion(row: dict[str, Any], source: str) -> tuple[dict[str, str], ...]:
    for key in ("prompt", "completion"):
        if not isinstance(row.get(key), str):
            raise ValueError(
                f"{source}: '{key}' must be a string (a line with 'prompt' needs 'completion' too)"
            )
    if not row["completion"].strip():
        raise ValueError(f"{source}: empty 'completion'; fill it or drop the line")
    return {"role": "user", "content": row["prompt"]}, {
        "role": "assistant",
        "content": row["completion"],
    }
