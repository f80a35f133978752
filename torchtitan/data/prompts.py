"""Prompts for GRPO (``training.dataset = "prompts"``): ``.jsonl`` rows with a ``prompt``
(a string, or chat messages that the tokenizer's chat template renders with the generation
prompt, as TRL's GRPOTrainer does) and any other columns the reward functions read
(``answer``, say).

The prompts of a step follow from the step alone: step ``s`` takes the ``P`` prompts after
those of the steps before it (``P`` = completions per step / group size), cycling through the
rows in file order, and data-parallel rank ``r`` of ``dp`` takes its ``P / dp`` consecutive
ones. So the order does not depend on the layout, and a resumed run needs no data state: its
step says where it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.data.hf_datasets import data_files
from torchtitan.data.sft import checked_messages, json_lines


@dataclass(frozen=True)
class PromptRow:
    """One prompt and its row (every column, the prompt included); ``source`` names it."""

    prompt: str | tuple[dict[str, str], ...]
    row: dict[str, Any]
    source: str

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


def load_prompt_files(path: str | None) -> list[PromptRow]:
    """Every row of the ``.jsonl`` file(s) at ``path``, checked."""
    assert path is not None  # load_documents enforces it for path datasets
    files, _ = data_files(path, "prompts")
    return [prompt_row(row, source) for file in files for row, source in json_lines(file)]


def prompt_row(row: Any, source: str) -> PromptRow:
    if isinstance(row, dict) and isinstance(row.get("prompt"), list):
        messages = checked_messages(row["prompt"], source, "prompt", needs_assistant=False)
        return PromptRow(messages, row, source)
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        keys = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
        raise ValueError(
            f"{source}: a prompt row needs a 'prompt', a string or chat messages (got {keys})"
        )
    if not row["prompt"].strip():
        raise ValueError(f"{source}: empty 'prompt'; fill it or drop the row")
    return PromptRow(row["prompt"], row, source)


def step_prompts(
    rows: list[PromptRow], step: int, per_step: int, dp_rank: int, dp_degree: int
) -> list[tuple[int, PromptRow]]:
    """This rank's prompts of ``step`` (1-based), each with its global index (which seeds its
    group's sampling)."""
    per_rank = per_step // dp_degree
    first = (step - 1) * per_step + dp_rank * per_rank
    return [(i, rows[i % len(rows)]) for i in range(first, first + per_rank)]
