"""fla's fused Triton chunked kernel for the gated delta rule (CUDA): the same numbers, faster."""

from __future__ import annotations

import functools
import os

import torch

from torchtitan.tools.logging import logger


@functools.cache
def _fla_imports() -> bool:
    """Whether ``fla.ops.gated_delta_rule`` imports (checked once per process)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as error:  # ImportError, or fla's own hardware probing failing
        logger.info(f"fla's gated delta rule unavailable ({error!r}): pure PyTorch delta rule")
        return False
    return True


@functools.cache
def _fla_backward_runs() -> bool:
    """Whether fla runs the rule's backward here: fla 0.6.0 refuses it (a RuntimeError, its
    issue #640: wrong gradients) on Hopper GPUs with Triton >= 3.4.0 and < 3.7.1 unless its
    TileLang backend (the ``tilelang`` package and nvcc) takes that kernel over."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return True
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend

        runs = CommonTileLangBackend.can_use()
    except Exception:
        runs = False
    if not runs or os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        logger.info(
            "fla's gated delta rule has no backward on Hopper GPUs with Triton >= 3.4.0 and "
            "< 3.7.1 without tilelang (fla issue #640): pure PyTorch delta rule where gradients "
            "are needed"
        )
        return False
    return True


def fla_available(device: torch.device, backward: bool = True) -> bool:
    """True on CUDA devices when ``fla.ops.gated_delta_rule`` imports and (``backward``) fla
    runs its backward there."""
    if device.type != "cuda" or not _fla_imports():
        return False
    return not backward or _fla_backward_runs()


def _cu_seqlens(document_ids: torch.Tensor) -> torch.Tensor:
    """The start of every document of ``document_ids`` ``[batch, seq]`` (non-decreasing along
    each row) in the flattened ``batch * seq`` tokens, then ``batch * seq``: a new document at
    every id change and at every row's first token (rows are separate sequences)."""
    batch, seq = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    ends = torch.tensor([batch * seq], dtype=torch.long, device=document_ids.device)
    return torch.cat([starts.flatten().nonzero().squeeze(-1), ends])


def fla_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~torchtitan.layers.gated_deltanet.chunk_gated_delta_rule`'s output (fp32) by
    fla's ``chunk_gated_delta_rule``, for the same ``[batch, heads, seq, ...]`` inputs
    (queries already L2-normalised and scaled, keys L2-normalised, log-decays ``g``, ``beta``
    in (0, 1)) and ``document_ids`` ``[batch, seq]`` (None: one document per row).

    Dtypes: fla's kernels multiply q, k and v in one dtype (``tl.dot`` takes operands of one
    type) and keep their accumulators, the gates' cumulative sums and the final state in fp32.
    Here q, k and v run in v's dtype when it is bf16 or fp16 (the activations' dtype in mixed
    precision: the kernels' fast path, also keeping the per-chunk states in that dtype), else
    in fp32 (fp32 matrix products in TF32 on Ampere and newer GPUs); g and beta always in
    fp32. The output comes back in fp32; the gradients in each input's own dtype.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    half = v.dtype in (torch.bfloat16, torch.float16)
    dtype = v.dtype if half else torch.float32
    # ours [batch, heads, seq, ...] -> fla's [batch, seq, heads, ...]
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    g, beta = (t.transpose(1, 2).float() for t in (g, beta))
    batch, seq = v.shape[:2]
    cu_seqlens = None
    if document_ids is not None:
        # packed documents: one row of batch * seq tokens, the documents cut by cu_seqlens
        q, k, v, g, beta = (t.flatten(0, 1).unsqueeze(0) for t in (q, k, v, g, beta))
        cu_seqlens = _cu_seqlens(document_ids.to(v.device))
    out, _ = chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=1.0,  # the queries come scaled
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,  # and normalised
        cu_seqlens=cu_seqlens,
    )
    return out.reshape(batch, seq, *out.shape[2:]).transpose(1, 2).float()
