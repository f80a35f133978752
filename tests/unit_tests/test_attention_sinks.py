"""Attention sinks (gpt-oss): a learned logit per head in every softmax's denominator, with
a zero value. Every kernel (the block kernel's fused CPU and block-math paths, SDPA's
causal path, FlexAttention) gives the output and the q / k / v / sink gradients of a dense
softmax with the sink column appended, under causal, windowed and document masks."""

from __future__ import annotations

import pytest
import torch

from tests.unit_tests.test_document_masking import DOC_LENGTHS, _document_ids, dense_mask
from torchtitan.layers.attention import (
    FlexAttention,
    MaskSpec,
    ScaledDotProductAttention,
)
from torchtitan.layers.blockwise_attention import blockwise_attention, build_block_plan

SEQ, HEADS, HEAD_DIM = 32, 3, 8
SCALE = HEAD_DIM**-0.5


def dense_with_sinks(q, k, v, sinks, document_ids=None, window=None):
    """The definition: softmax over [scores, sink] per query row, the sink column dropped."""
    mask = dense_mask(q, document_ids, window)
    scores = (q @ k.transpose(-2, -1) * SCALE).masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def _inputs(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, SEQ, HEAD_DIM, dtype=dtype, requires_grad=True) for _ in "qkv")
    sinks = torch.tensor([0.5, -1.0, 2.0], dtype=dtype, requires_grad=True)
    return q, k, v, sinks


def _grads(out, tensors):
    return torch.autograd.grad((out * out.detach().cos()).sum(), tensors)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-6)]
)  # block math / fused CPU kernels
@pytest.mark.parametrize("documents", [True, False])
@pytest.mark.parametrize("window", [None, 6])
def test_block_kernel_with_sinks_matches_the_dense_definition(dtype, tol, documents, window):
    q, k, v, sinks = _inputs(dtype)
    document_ids = _document_ids(DOC_LENGTHS) if documents else None
    chunks = list(range(SEQ // 8))
    plan = build_block_plan(chunks, chunks, 8, document_ids, window)
    out = blockwise_attention(q, k, v, plan, chunks, chunks, SCALE, sinks)
    ref = dense_with_sinks(q, k, v, sinks, document_ids, window)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for g, r in zip(_grads(out, (q, k, v, sinks)), _grads(ref, (q, k, v, sinks))):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)


def test_ignoring_the_sinks_fails_the_comparison():
    """The planted error: the same kernel without its sinks is far from the definition."""
    q, k, v, sinks = _inputs(torch.float64)
    chunks = list(range(SEQ // 8))
    plan = build_block_plan(chunks, chunks, 8, None, None)
    out = blockwise_attention(q, k, v, plan, chunks, chunks, SCALE)
    assert (out - dense_with_sinks(q, k, v, sinks)).abs().max() > 1e-2


def test_sdpa_kernel_with_sinks_matches_the_dense_definition():
    q, k, v, sinks = _inputs(torch.float32)
    out = ScaledDotProductAttention()(q, k, v, scale=SCALE, sinks=sinks)
    ref = dense_with_sinks(q, k, v, sinks)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    for g, r in zip(_grads(out, (q, k, v, sinks)), _grads(ref, (q, k, v, sinks))):
        torch.testing.assert_close(g, r, rtol=2e-6, atol=2e-6)


def test_flex_kernel_with_sinks_matches_the_dense_definition():
    """FlexAttention with a window and documents: on the CPU (no backward, no log-sum-exp
    from its compiled kernel) both inference and training run the block kernel; on CUDA the
    compiled kernel's log-sum-exp takes the sinks (tests/unit_tests/test_gpu.py)."""
    q, k, v, sinks = _inputs(torch.float32)
    document_ids = _document_ids(DOC_LENGTHS)
    kernel = FlexAttention(MaskSpec(block_causal=True, sliding_window=6))
    ref = dense_with_sinks(q, k, v, sinks, document_ids, window=6)
    with torch.no_grad():
        mask = kernel.prepare(document_ids, q.device)
        assert mask.block_mask is not None
        out = kernel(q, k, v, mask=mask, scale=SCALE, sinks=sinks)
    torch.testing.assert_close(out, ref.detach(), rtol=2e-6, atol=2e-6)
    out = kernel(q, k, v, mask=kernel.prepare(document_ids, q.device), scale=SCALE, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    for g, r in zip(_grads(out, (q, k, v, sinks)), _grads(ref, (q, k, v, sinks))):
        torch.testing.assert_close(g, r, rtol=2e-6, atol=2e-6)


def test_mixed_dtypes_under_autocast_attend_in_the_autocast_dtype():
    """transformers' rotary hands q and k over in fp32 and v in bf16 under autocast: the
    kernel computes as on all-bf16 inputs (as autocast does for SDPA), on any CPU."""
    q, k, v, _ = _inputs(torch.float32)
    kernel = FlexAttention(MaskSpec(block_causal=True))
    mask = kernel.prepare(_document_ids(DOC_LENGTHS), q.device)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernel(q, k, v.bfloat16(), mask=mask)
        same = kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask=mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, same, rtol=0, atol=0)
