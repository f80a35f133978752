"""What an RMSNorm keeps for backward besides its output, per normalised row."""

from __future__ import annotations

from torchtitan.protocols.geometry import Geometry


def norm_kept_bytes(a: int, d: int, target: str) -> float:
    """Per token, what one rms_norm keeps besides its output: CUDA's fused kernel keeps the
    input and an fp32 rstd; the CPU decomposition keeps an fp32 input (the input itself in
    fp32, else an fp32 copy while the input is dropped), an fp32 normalised copy and rstd."""
    if target == "cuda":
        return a * d + 4
    return 4 * d + 4 * d + 4


def model_norm_kept_bytes(g: Geometry, a: int, d: int, target: str) -> float:
    """:func:`norm_kept_bytes` for the model's RMSNorms. A zero-centred one (``layers/
    norms.py``) normalises an fp32 copy of its input (the input itself when fp32) without a
    weight and scales by ``1 + weight`` after: on either target the fp32 input, an fp32 rstd
    and the fp32 normalised values (kept by the scale)."""
    if g.zero_centred_norms:
        return 4 * d + 4 + 4 * d
    return norm_kept_bytes(a, d, target)
