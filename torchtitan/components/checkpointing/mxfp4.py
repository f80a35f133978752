"""MXFP4 weights as gpt-oss's released checkpoints store its experts: ``<name>_blocks``
(uint8 ``[experts, rows, groups, 16]``, two 4-bit E2M1 values per byte, the low nibble first)
and ``<name>_scales`` (uint8 ``[experts, rows, groups]``, a power-of-two exponent biased by
127) for every 32 values of a row. Dequantised, ``<name>`` is ``[experts, columns, rows]``
(the transposed layout Hugging Face's gpt-oss keeps in memory).

Written here: the loader reads safetensors one tensor group at a time, and transformers'
converter is tied to its own loading (and dequantises in the target dtype). Every E2M1 value
times a power of two is exact in fp32 (and in bf16, which has fp32's exponent range), so
dequantising in fp32 and casting gives transformers' values bit for bit.
"""

from __future__ import annotations

import torch

BLOCKS, SCALES = "_blocks", "_scales"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of a 4-bit E2M1 code (sign bit 3)."""


def packed_keys(keys: set[str]) -> dict[str, tuple[str, str]]:
    """Dense key -> (blocks key, scales key) for every complete blocks/scales pair."""
    return {
        key.removesuffix(BLOCKS): (key, key.removesuffix(BLOCKS) + SCALES)
        for key in keys
        if key.endswith(BLOCKS) and key.removesuffix(BLOCKS) + SCALES in keys
    }


def dense_shape(blocks_shape: list[int]) -> list[int]:
    """The dequantised shape of blocks ``[experts, rows, groups, bytes]``."""
    experts, rows, groups, width = blocks_shape
    return [experts, groups * width * 2, rows]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[experts, columns, rows]`` from MXFP4 blocks and scales, one expert at a time
    (the largest released tensor is 8 GiB in fp32; one expert is 1/128 of it at a time
    besides the result)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.dim() != 4 or blocks.shape[:3] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            "([experts, rows, groups, bytes] and [experts, rows, groups])"
        )
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    out = torch.empty(dense_shape(list(blocks.shape)), dtype=torch.float32, device=blocks.device)
    for expert in range(blocks.shape[0]):
        codes = blocks[expert]
        values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)
        exponents = scales[expert].to(torch.int32) - 127
        values = torch.ldexp(values.flatten(-2), exponents.unsqueeze(-1))
        out[expert] = values.flatten(-2).T
    return out


def quantize(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks and scales of fp32 ``[experts, columns, rows]`` (columns a multiple of
    32): each 32 values share the power of two that puts their largest magnitude in E2M1's
    range, each value rounds to the nearest code. For writing released-style test folders."""
    experts, columns, rows = dense.shape
    groups = dense.transpose(1, 2).reshape(experts, rows, columns // 32, 32).float()
    largest = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponents = (torch.floor(torch.log2(largest)) - 2).clamp(-127, 127)  # 6 = 1.5 * 2^2
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + 127).to(torch.uint8)
