"""A reproducible permutation of sequence positions that needs no index of the corpus.

Positions are shuffled within consecutive blocks of ``window`` positions (a whole pass over
the data when the window is that large): position ``p`` goes to ``block * window + f(p mod
window)`` where ``f`` is a bijection of ``[0, window)`` keyed by the seed and the block. ``f``
is a four-round Feistel network on the smallest power-of-four domain covering the window,
walked in cycles until it lands inside the window (the standard way to restrict a Feistel
permutation to a range): O(1) memory, a few microseconds per position, the same on every rank
and after every resume because it depends on nothing but (seed, block, position).

Written here because no library the project uses offers a keyed permutation of a range.
"""

from __future__ import annotations

import hashlib

_ROUNDS = 4
_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class BlockShuffle:
    """``position -> shuffled position`` within blocks of ``window`` positions."""

    def __init__(self, seed: int, window: int, salt: str = "") -> None:
        if window < 1:
            raise ValueError(f"shuffle window must be >= 1, got {window}")
        self.seed = seed
        self.window = window
        self._key = int.from_bytes(hashlib.sha256(f"{seed}/{salt}".encode()).digest()[:8], "little")
        half_bits = max(1, (max(window - 1, 1).bit_length() + 1) // 2)
        self._half_bits = half_bits
        self._half_mask = (1 << half_bits) - 1

    def __call__(self, position: int) -> int:
        block, offset = divmod(position, self.window)
        if self.window == 1:
            return position
        value = self._permute(offset, block)
        while value >= self.window:  # cycle-walk back into the window
            value = self._permute(value, block)
        return block * self.window + value

    def _permute(self, value: int, block: int) -> int:
        left, right = value >> self._half_bits, value & self._half_mask
        for round_index in range(_ROUNDS):
            key = _mix(self._key ^ _mix(block * _ROUNDS + round_index))
            left, right = right, left ^ (_mix(key ^ right) & self._half_mask)
        return (left << self._half_bits) | right
