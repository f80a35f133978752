"""The single seam through which every model computes attention.

Every attention kernel is an :class:`AttentionKernel`: the model asks its first kernel to
``prepare`` the mask once per forward (from the batch's document ids) and hands the result
to every layer's kernel with ``q, k, v``. Context parallelism, the generation KV cache and any
alternative kernel replace these modules instead of patching each model.

Kernels here:

- :class:`ScaledDotProductAttention` (``model.attn_type = "sdpa"``): causal SDPA, no mask
  object; with attention sinks (which need the log-sum-exp SDPA does not return) the
  block-by-block kernel on the causal mask.
- :class:`FlexAttention` (``"flex"``): causal, ``block_causal`` (documents of a packed
  sequence never see each other) and sliding-window masks. It runs the compiled FlexAttention
  kernel with a ``BlockMask`` built once per batch, except where FlexAttention has no
  backward (the CPU, in 2.11 - 2.13): training there runs the same mask block by block
  (``torchtitan/layers/blockwise_attention.py``), skipping fully masked blocks.

Attention sinks (gpt-oss: a learned logit per head added to every softmax's denominator,
``sinks`` ``[heads]``) rescale a kernel's output by its log-sum-exp
(``blockwise_attention.add_sinks``), so no kernel materialises ``[seq, seq]`` for them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.layers.blockwise_attention import (
    BlockPlan,
    add_sinks,
    blockwise_attention,
    build_block_plan,
    visible,
)

MAX_BLOCK = 512
"""Largest chunk of the block-by-block path (a [chunk, chunk] fp32 block per step)."""


@dataclass(frozen=True)
class MaskSpec:
    """The attention mask a model was configured with."""

    block_causal: bool = False
    sliding_window: int | None = None

    @property
    def causal_only(self) -> bool:
        return not self.block_causal and self.sliding_window is None

    @classmethod
    def from_config(cls, attn_mask_type: str, sliding_window: int | None) -> MaskSpec:
        return cls(block_causal=attn_mask_type == "block_causal", sliding_window=sliding_window)


@dataclass(frozen=True)
class PreparedMask:
    """One batch's mask, built once per forward and shared by every layer: the document ids
    ``[batch, seq]`` (None unless block_causal) and the kernel-specific form (a FlexAttention
    ``BlockMask`` or a :class:`BlockPlan`)."""

    document_ids: torch.Tensor | None
    block_mask: Any = None
    plan: BlockPlan | None = None


class AttentionKernel(nn.Module):
    """``forward(q, k, v, *, mask, scale, sinks)`` on ``[batch, heads, seq, head_dim]`` tensors
    where ``k``/``v`` already have as many heads as ``q`` (callers expand grouped KV heads
    first); returns a tensor shaped like ``q``. ``scale``: softmax scale, by default
    ``1 / sqrt(head_dim)``. ``mask`` is what :meth:`prepare` returned for this batch.
    ``sinks``: None, or ``[heads]`` logits added to every softmax's denominator."""

    spec: MaskSpec = MaskSpec()

    def prepare(self, document_ids: torch.Tensor | None, device: torch.device) -> Any:
        """The mask of a batch on ``device`` from ``document_ids`` ``[batch, seq]`` of the
        whole sequences (under context parallel, of every rank's tokens). None: no document
        ids given; the kernel then masks by position only, the mask built from the shapes it
        sees."""
        return None


class ScaledDotProductAttention(AttentionKernel):
    """Causal scaled-dot-product attention (the fused SDPA kernels)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Any = None,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        plan = _local_plan(None, q.shape[2], None, q.device)
        chunks = list(range(q.shape[2] // plan.size))
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return blockwise_attention(q, k, v, plan, chunks, chunks, scale, sinks)


@functools.cache
def compiled_flex_attention():
    """``flex_attention`` compiled once per process (uncompiled it materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_has_backward(device: torch.device) -> bool:
    return device.type != "cpu"


CPU_FLEX_MULTIPLE = 16
"""Sequence lengths the CPU's compiled FlexAttention computes right are multiples of this
(torch 2.13: 8, 24, 40, 56 or 72 tokens give wrong rows or NaN, from some inputs only)."""


def _blockwise(device: torch.device, seq_len: int) -> bool:
    """Whether this forward needs the block-by-block kernel: a backward FlexAttention lacks,
    or a length the CPU's compiled FlexAttention gets wrong."""
    if flex_has_backward(device):
        return False
    return torch.is_grad_enabled() or seq_len % CPU_FLEX_MULTIPLE != 0


def chunk_size(seq_len: int) -> int:
    """The largest divisor of ``seq_len`` up to :data:`MAX_BLOCK`."""
    return next(c for c in range(min(seq_len, MAX_BLOCK), 0, -1) if seq_len % c == 0)


def document_block_mask(
    spec: MaskSpec, document_ids: torch.Tensor | None, seq_len: int, device: torch.device
):
    """The FlexAttention ``BlockMask`` of :func:`visible` for one batch."""
    from torch.nn.attention.flex_attention import create_block_mask

    window = spec.sliding_window
    if document_ids is None:

        def mask_mod(b, h, q, k):
            return visible(q, k, None, None, window)

        return create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)

    def doc_mask_mod(b, h, q, k):
        return visible(q, k, document_ids[b, q], document_ids[b, k], window)

    return create_block_mask(
        doc_mask_mod, document_ids.shape[0], None, seq_len, seq_len, device=device
    )


def _local_plan(
    document_ids: torch.Tensor | None, seq_len: int, window: int | None, device: torch.device
) -> BlockPlan:
    chunks = list(range(seq_len // chunk_size(seq_len)))
    return build_block_plan(chunks, chunks, chunk_size(seq_len), document_ids, window, device)


def _position_only_mask(
    spec: MaskSpec, seq_len: int, device: torch.device, blockwise: bool
) -> PreparedMask:
    """A mask that depends on positions only (no documents). Built per forward, not cached
    across calls: a cache would carry tensors between real runs and fake-tensor traces."""
    if blockwise:
        return PreparedMask(None, plan=_local_plan(None, seq_len, spec.sliding_window, device))
    return PreparedMask(None, block_mask=document_block_mask(spec, None, seq_len, device))


class FlexAttention(AttentionKernel):
    """Attention under any :class:`MaskSpec` (see the module docstring for the kernels)."""

    def __init__(self, spec: MaskSpec) -> None:
        super().__init__()
        self.spec = spec

    def prepare(
        self, document_ids: torch.Tensor | None, device: torch.device
    ) -> PreparedMask | None:
        if document_ids is None:
            return None
        seq_len = document_ids.shape[1]
        blockwise = _blockwise(device, seq_len)
        if not self.spec.block_causal:
            return _position_only_mask(self.spec, seq_len, device, blockwise)
        if blockwise:
            return PreparedMask(
                document_ids,
                plan=_local_plan(document_ids, seq_len, self.spec.sliding_window, device),
            )
        return PreparedMask(
            document_ids, block_mask=document_block_mask(self.spec, document_ids, seq_len, device)
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: PreparedMask | None = None,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = autocast_inputs(q, k, v)
        mask = own_mask(mask, self.spec)
        if mask is None:  # no document ids (generation, direct calls): any length, so on the
            # CPU the eager block kernel rather than a compilation per length
            blockwise = not flex_has_backward(q.device)
            mask = _position_only_mask(self.spec, q.shape[2], q.device, blockwise)
        if mask.plan is None and sinks is not None and not flex_has_backward(q.device):
            # the CPU's compiled FlexAttention returns no log-sum-exp: the block kernel
            window = self.spec.sliding_window
            plan = _local_plan(mask.document_ids, q.shape[2], window, q.device)
            mask = PreparedMask(mask.document_ids, plan=plan)
        if mask.plan is not None:
            chunks = list(range(q.shape[2] // mask.plan.size))
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            return blockwise_attention(q, k, v, mask.plan, chunks, chunks, scale, sinks)
        flex = compiled_flex_attention()
        if sinks is None:
            return flex(q, k, v, block_mask=mask.block_mask, scale=scale)
        out, lse = flex(q, k, v, block_mask=mask.block_mask, scale=scale, return_lse=True)
        return add_sinks(out, lse, sinks)[0]

    def extra_repr(self) -> str:
        return f"block_causal={self.spec.block_causal}, sliding_window={self.spec.sliding_window}"


def autocast_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under autocast, q, k and v in the autocast dtype, as autocast gives them to SDPA: the
    block kernel turns autocast off and FlexAttention is outside it, and a model may hand
    them over in different dtypes (transformers' rotary makes q and k fp32, v stays bf16)."""
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return q.to(dtype), k.to(dtype), v.to(dtype)


LOCAL_KERNELS = (ScaledDotProductAttention, FlexAttention)
"""The kernels that attend within one process; context parallel and the KV cache replace them."""


def build_attention(attn_type: str, spec: MaskSpec) -> AttentionKernel:
    """The kernel a model's attention layers use (``model.attn_type``)."""
    if attn_type == "flex":
        return FlexAttention(spec)
    if not spec.causal_only:
        raise ValueError(f"attn_type {attn_type!r} supports the causal mask only; use 'flex'")
    return ScaledDotProductAttention()


@dataclass(frozen=True)
class MaskSet:
    """The batch's masks of a model whose layers differ in mask (gpt-oss alternates a
    sliding window with full attention), one per :class:`MaskSpec`."""

    masks: dict[MaskSpec, Any]


def own_mask(mask: Any, spec: MaskSpec) -> Any:
    """A kernel's own mask out of what :func:`prepare_mask` returned."""
    return mask.masks[spec] if isinstance(mask, MaskSet) else mask


def prepare_mask(layers: nn.Module, document_ids: torch.Tensor | None, device: torch.device) -> Any:
    """The batch's mask, prepared once per forward by the first attention kernel under
    ``layers`` of each distinct :class:`MaskSpec` (a :class:`MaskSet` when there are several;
    all layers of a model use one kernel type); None when there is no kernel (a stage
    without layers)."""
    kernels: dict[MaskSpec, AttentionKernel] = {}
    for module in layers.modules():
        if isinstance(module, AttentionKernel):
            kernels.setdefault(module.spec, module)
    if len(kernels) <= 1:
        kernel = next(iter(kernels.values()), None)
        return None if kernel is None else kernel.prepare(document_ids, device)
    return MaskSet({spec: k.prepare(document_ids, device) for spec, k in kernels.items()})


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """RoPE positions ``[batch, seq]`` that restart at 0 at every document start."""
    seq_len = document_ids.shape[1]
    index = torch.arange(seq_len, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index
