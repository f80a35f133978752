"""One data state from the states of all data-parallel ranks, loadable under any dp degree."""

from __future__ import annotations

from typing import Any

from torchtitan.data.mixture import merge_mixture_states
from torchtitan.data.packing import merge_shard_states


def merge_data_states(states: list[dict[str, Any]], partial: bool = False) -> dict[str, Any]:
    """A text dataset's shard cursors united (``packing.merge_shard_states``; ``partial``: of
    some of the dp ranks only), or a token store's or mixture's next position
    (``mixture.merge_mixture_states``)."""
    if states and "sources" in states[0]:
        return merge_mixture_states(states)
    return merge_shard_states(states, partial)
