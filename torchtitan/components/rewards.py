"""Reward functions for GRPO, registered by name like train specs (``grpo.reward_funcs``).

A reward function takes a group's completions (decoded text, cut after their stop token) and
the prompt's row (its ``prompt`` and any other columns, e.g. ``answer``) and returns one float
per completion. Two ship here: ``exact_match`` (verifiable answers: 1 where the completion,
stripped, equals the row's ``answer``) and ``format`` (1 where the completion is a single
number, the shape an arithmetic answer must have). ``register_reward`` adds more (from a
module named by ``experimental.custom_import``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

RewardFn = Callable[[list[str], dict[str, Any]], list[float]]

_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str, fn: RewardFn) -> None:
    """Register ``fn`` under ``name``; registering a name again replaces the earlier one."""
    _REWARDS[name] = fn


def registered_rewards() -> list[str]:
    return sorted(_REWARDS)


def get_reward(name: str) -> RewardFn:
    if name not in _REWARDS:
        raise ValueError(
            f"grpo.reward_funcs: unknown reward function {name!r}; registered: "
            f"{', '.join(registered_rewards())}"
        )
    return _REWARDS[name]


def exact_match(completions: list[str], row: dict[str, Any]) -> list[float]:
    """1.0 where the completion, stripped, is the row's ``answer`` (as text), else 0.0."""
    if "answer" not in row:
        raise ValueError(
            f"reward exact_match needs an 'answer' column; the row has {', '.join(row)}"
        )
    answer = str(row["answer"]).strip()
    return [float(completion.strip() == answer) for completion in completions]


_NUMBER = re.compile(r"\s*-?\d+(\.\d+)?\s*")


def number_format(completions: list[str], row: dict[str, Any]) -> list[float]:
    """1.0 where the completion is one number and nothing else, else 0.0."""
    del row
    return [float(_NUMBER.fullmatch(completion) is not None) for completion in completions]


register_reward("exact_match", exact_match)
register_reward("format", number_format)
