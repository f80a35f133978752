"""Rotary position embeddings (RoPE) from real cos/sin tables, applied as complex multiplies.

Every model here rotates adjacent channel pairs ``(2i, 2i + 1)`` of a head at frequency
``i`` (Meta's layout). Hugging Face's Llama and Qwen3 rotate channel ``i`` with
``i + d / 2`` instead; their state-dict adapters permute the q/k weights between the two
(:mod:`torchtitan.models.common.hf_keys`).

Frequencies: plain (``theta ** (-2i / d)``), Llama 3.1 scaling and YaRN. A table holds one
row per position: cos of every frequency in the first half, sin in the second.
"""

from __future__ import annotations

import math

import torch


def rope_frequencies(
    rotary_dim: int, theta: float, device: torch.device | None = None
) -> torch.Tensor:
    """``[rotary_dim // 2]`` fp32 inverse frequencies ``theta ** (-2i / rotary_dim)``."""
    exponents = torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim
    return 1.0 / (theta**exponents)


def llama3_scaled(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_len: int,
) -> torch.Tensor:
    """Llama 3.1 scaling: low frequencies (wavelengths beyond ``original_max_len /
    low_freq_factor``) are divided by ``factor``, high ones (below ``original_max_len /
    high_freq_factor``) kept, and the band between interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original_max_len / low_freq_factor, inv_freq / factor, smoothed)
    return torch.where(wavelen < original_max_len / high_freq_factor, inv_freq, scaled)


def yarn_scaled(
    inv_freq: torch.Tensor,
    rotary_dim: int,
    theta: float,
    factor: float,
    original_max_len: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context
    are divided by ``factor``, those turning more than ``beta_fast`` times are kept, and a
    linear ramp over the channel index blends the band between (its ends rounded to whole
    channels unless ``truncate`` is False, as gpt-oss's config says)."""

    def channel(rotations: float) -> float:
        """The channel index whose frequency turns ``rotations`` times over the context."""
        return (
            rotary_dim
            * math.log(original_max_len / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = channel(beta_fast), channel(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    index = torch.arange(rotary_dim // 2, device=inv_freq.device, dtype=torch.float32)
    keep = 1 - ((index - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature: softmax scales are multiplied by its square."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_table(inv_freq: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """``[max_seq_len, 2 * len(inv_freq)]`` fp32: row ``p`` holds cos then sin of
    ``p * inv_freq``."""
    positions = torch.arange(max_seq_len, device=inv_freq.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope(
    x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, rotary_dim]`` by position, in fp32, cast back.

    ``positions`` holds each token's absolute position, ``[seq]`` or ``[batch, seq]``
    (context parallel passes the global positions of a local shard, generation those of
    the new tokens); by default ``0 .. seq - 1``.

    Each channel pair is one complex number multiplied by ``cos + i sin``: one complex
    multiply costs about a third of the same rotation in real arithmetic (unflatten,
    four multiplies, add/sub, stack) forward and backward on CPU. The table stays real
    (a complex buffer would be truncated by ``module.to(bfloat16)``); tensor and context
    parallelism hand this function local tensors, so no DTensor reaches the complex path.
    """
    rows = table[: x.shape[1]] if positions is None else table[positions]
    cos, sin = rows.unsqueeze(-2).chunk(2, dim=-1)  # broadcast over heads
    rotation = torch.complex(cos.float(), sin.float())
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope` on queries and keys alike."""
    return apply_rope(xq, table, positions), apply_rope(xk, table, positions)
