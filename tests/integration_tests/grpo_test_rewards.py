"""Test-only reward (loaded with --experimental.custom_import): the share of digits in a
completion, which a random debug model's samples already vary on, so that the parity tests
have non-zero advantages from the first step."""

from torchtitan.components.rewards import register_reward


def digit_share(completions: list[str], row: dict) -> list[float]:
    del row
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


register_reward("digit_share", digit_share)
