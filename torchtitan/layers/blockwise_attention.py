"""Masked attention computed block by block: the CPU training path of FlexAttention (whose
backward has no CPU kernel) and the block math of context-parallel attention.

A sequence is cut into chunks of ``size`` tokens; chunk ``c`` holds the global positions
``[c * size, (c + 1) * size)``. A :class:`BlockPlan` lists, for every (query chunk, key chunk)
pair that has at least one visible pair of tokens, the bool mask of that block, or None when
every key of the block is visible to every query. Pairs with nothing visible (the future, out
of the window, another document) are skipped, so the work follows the mask's sparsity and no
``[seq, seq]`` tensor is ever built: at most a few ``[chunk, chunk]`` blocks are alive.

Visibility, everywhere in torchtitan (:func:`visible`): key position ``<=`` query position,
within the sliding window if there is one, and in the same document when document ids are
given. Document ids must not decrease along a sequence (the packer numbers documents in order).

On the CPU in fp32/bf16 the blocks run through the fused flash-attention kernels, which
return the log-sum-exp; elsewhere (fp64, CUDA) the block math works in fp32 (fp64 for fp64
inputs) on pre-scaled queries. Either way partial results merge by log-sum-exp and the
backward recomputes each block from the final log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Mask = torch.Tensor | None
"""A block's visibility ``[batch or 1, 1, q chunk, k chunk]`` (bool); None: all visible."""


def visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """Whether each query sees each key (broadcasting): causal, windowed, same document."""
    seen = k_pos <= q_pos
    if window is not None:
        seen = seen & (q_pos - k_pos < window)
    if q_doc is not None:
        seen = seen & (q_doc == k_doc)
    return seen


@dataclass(frozen=True)
class BlockPlan:
    """The visible blocks between chunks of ``size`` tokens, keyed by global chunk ids."""

    size: int
    blocks: dict[tuple[int, int], Mask]

    def pairs(self, q_chunks: list[int], k_chunks: list[int]) -> list[tuple[int, int, Mask]]:
        """(local q chunk index, local k chunk index, mask) of every visible block."""
        return [
            (a, b, self.blocks[(qc, kc)])
            for a, qc in enumerate(q_chunks)
            for b, kc in enumerate(k_chunks)
            if (qc, kc) in self.blocks
        ]


def build_block_plan(
    q_chunks: list[int],
    k_chunks: list[int],
    size: int,
    document_ids: torch.Tensor | None,
    window: int | None,
    device: torch.device | None = None,
) -> BlockPlan:
    """The plan for queries in ``q_chunks`` against keys in ``k_chunks``; masks on the
    document ids' device (else ``device``).

    ``document_ids`` ``[batch, seq]`` covers the whole (global) sequence. Deciding which blocks
    to skip reads each chunk's first and last document id on the host: one device-to-host
    copy of ``[batch, chunks]`` ints per plan (per micro-batch, shared by every layer).
    """
    device = document_ids.device if document_ids is not None else device
    first = last = None
    if document_ids is not None:
        by_chunk = document_ids.unflatten(1, (-1, size))
        first, last = by_chunk[:, :, 0].tolist(), by_chunk[:, :, -1].tolist()
    blocks: dict[tuple[int, int], Mask] = {}
    for qc in q_chunks:
        for kc in k_chunks:
            kind = _block_kind(qc, kc, size, window, first, last)
            if kind == "skip":
                continue
            blocks[(qc, kc)] = (
                None if kind == "full" else _block_mask(qc, kc, size, document_ids, window, device)
            )
    return BlockPlan(size, blocks)


def _block_kind(
    qc: int,
    kc: int,
    size: int,
    window: int | None,
    first: list[list[int]] | None,
    last: list[list[int]] | None,
) -> str:
    """'skip' (nothing visible), 'full' (everything visible) or 'partial'."""
    q0, q1, k0, k1 = qc * size, (qc + 1) * size - 1, kc * size, (kc + 1) * size - 1
    if k0 > q1 or (window is not None and q0 - k1 >= window):
        return "skip"
    full = k1 <= q0 and (window is None or q1 - k0 < window)
    if first is not None:
        rows = range(len(first))
        if not any(first[b][qc] <= last[b][kc] and first[b][kc] <= last[b][qc] for b in rows):
            return "skip"
        full = full and all(
            first[b][qc] == last[b][qc] == first[b][kc] == last[b][kc] for b in rows
        )
    return "full" if full else "partial"


def _block_mask(
    qc: int,
    kc: int,
    size: int,
    document_ids: torch.Tensor | None,
    window: int | None,
    device: torch.device | None,
) -> torch.Tensor:
    q_pos = torch.arange(qc * size, (qc + 1) * size, device=device)[:, None]
    k_pos = torch.arange(kc * size, (kc + 1) * size, device=device)[None, :]
    q_doc = k_doc = None
    if document_ids is not None:
        q_doc = document_ids[:, qc * size : (qc + 1) * size, None]
        k_doc = document_ids[:, None, kc * size : (kc + 1) * size]
    mask = visible(q_pos, k_pos, q_doc, k_doc, window)
    return mask.unsqueeze(1) if mask.dim() == 3 else mask[None, None]


# ---------------------------------------------------------------------------- block math
# The block functions run outside autograd and work in place: at most two [c, c] fp32
# blocks are alive at a time. ``q`` arrives pre-multiplied by the softmax scale.
def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that sees nothing in this block) replaced by 0, so that
    ``exp(-inf - lse)`` gives 0 instead of NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def block_probs(
    q: torch.Tensor, k: torch.Tensor, mask: Mask, lse: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(q k^T - lse)`` over the visible keys and the lse used (computed when not given)."""
    s = q @ k.transpose(-2, -1)
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    if lse is None:
        lse = s.logsumexp(-1)
    return s.sub_(_finite(lse).unsqueeze(-1)).exp_(), lse


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
) -> tuple[torch.Tensor, torch.Tensor]:
    p, lse = block_probs(q, k, mask)
    return p @ v, lse


def merge_blocks(
    out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax-attention results over disjoint key sets."""
    if out is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    base = _finite(new)
    weight, weight_b = torch.exp(lse - base).unsqueeze(-1), torch.exp(lse_b - base).unsqueeze(-1)
    return out.mul_(weight).add_(out_b.mul_(weight_b)), new


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: Mask,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block, given the final (all-block) ``lse`` and
    ``delta = rowsum(dout * out)``."""
    p, _ = block_probs(q, k, mask, lse)
    dv = p.transpose(-2, -1) @ dout
    ds = (dout @ v.transpose(-2, -1)).sub_(delta.unsqueeze(-1)).mul_(p)
    return (ds @ k).mul_(scale), ds.transpose(-2, -1) @ q, dv


# ---------------------------------------------------------------------------- local attention
def _accumulation_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and lower precisions; fp64 stays fp64 (exact reference checks)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def fused(q: torch.Tensor) -> bool:
    """On the CPU each query chunk runs through the fused flash-attention kernels over its
    visible key range in one call (a ``[chunk, range]`` mask, rebuilt in the backward rather
    than saved), several times faster than the block math below."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def _row_spans(
    plan: BlockPlan, q_chunks: list[int], k_chunks: list[int]
) -> list[tuple[int, int, int, list[Mask]]]:
    """Per local query chunk with visible keys: (q index, first k index, end k index, the
    masks of the k chunks in between, a skipped one as all False). The fused kernels then
    run once per query chunk over one contiguous key range instead of once per block."""
    by_row: dict[int, dict[int, Mask]] = {}
    for a, b, mask in plan.pairs(q_chunks, k_chunks):
        by_row.setdefault(a, {})[b] = mask
    spans = []
    for a in sorted(by_row):
        row = by_row[a]
        columns = sorted(row)
        first, end = columns[0], columns[-1] + 1
        spans.append((a, first, end, [row.get(b, False) for b in range(first, end)]))
    return spans


def _span_mask(
    masks: list, size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """The additive mask (0 visible, -inf not) of one query chunk over its key range; None
    when every key is visible."""
    if all(m is None for m in masks):
        return None
    batch = max([1, *(m.shape[0] for m in masks if isinstance(m, torch.Tensor))])
    parts = []
    for m in masks:
        if m is None:
            parts.append(torch.ones(batch, 1, size, size, dtype=torch.bool, device=device))
        elif m is False:
            parts.append(torch.zeros(batch, 1, size, size, dtype=torch.bool, device=device))
        else:
            parts.append(m.expand(batch, -1, -1, -1))
    seen = torch.cat(parts, dim=-1)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))


def fused_partial_forward(
    q, k, v, plan: BlockPlan, q_chunks, k_chunks, scale
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernels' attention of ``q`` over the keys of ``k_chunks`` only: (out in q's
    dtype, fp32 log-sum-exp); rows that see none of these keys get 0 and -inf, ready for
    :func:`merge_blocks` with the other key sets' results (ring attention)."""
    size = plan.size
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for a, first, end, masks in _row_spans(plan, q_chunks, k_chunks):
        rows, keys = slice(a * size, (a + 1) * size), slice(first * size, end * size)
        mask = _span_mask(masks, size, q.dtype, q.device)
        out_a, lse_a = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            0.0,
            False,
            attn_mask=mask,
            scale=scale,
        )
        if mask is not None:  # the kernel gives a row that sees no key here lse 0, not -inf
            lse_a = lse_a.masked_fill(~(mask > float("-inf")).any(-1), float("-inf"))
        out[:, :, rows], lse[:, :, rows] = out_a, lse_a
    return out, lse


def fused_partial_backward(
    q,
    k,
    v,
    out,
    lse,
    grad_out,
    plan: BlockPlan,
    q_chunks,
    k_chunks,
    scale,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> torch.Tensor:
    """dq (q's dtype) of the blocks over the keys of ``k_chunks``, their dk and dv added into
    the fp32 ``dk``/``dv``, given the output and log-sum-exp over ALL keys: the flash
    backward recomputes each block's probabilities from them, so per-key-set gradients add
    up to the full ones."""
    size = plan.size
    grad_out = grad_out.to(q.dtype)
    dq = torch.zeros_like(q)
    for a, first, end, masks in _row_spans(plan, q_chunks, k_chunks):
        rows, keys = slice(a * size, (a + 1) * size), slice(first * size, end * size)
        dq_a, dk_a, dv_a = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out[:, :, rows],
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            out[:, :, rows],
            lse[:, :, rows],
            0.0,
            False,
            attn_mask=_span_mask(masks, size, q.dtype, q.device),
            scale=scale,
        )
        dq[:, :, rows] = dq_a
        dk[:, :, keys] += dk_a
        dv[:, :, keys] += dv_a
    return dq


def _forward(
    q, k, v, plan: BlockPlan, q_chunks, k_chunks, scale
) -> tuple[torch.Tensor, torch.Tensor]:
    if fused(q):
        return fused_partial_forward(q, k, v, plan, q_chunks, k_chunks, scale)
    size, acc = plan.size, _accumulation_dtype(q)
    qs = (q.to(acc) * scale).split(size, dim=2)
    ks, vs = k.to(acc).split(size, dim=2), v.to(acc).split(size, dim=2)
    outs: list = [None] * len(q_chunks)
    lses: list = [None] * len(q_chunks)
    for a, b, mask in plan.pairs(q_chunks, k_chunks):
        outs[a], lses[a] = merge_blocks(outs[a], lses[a], *block_forward(qs[a], ks[b], vs[b], mask))
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def _backward(q, k, v, out, lse, grad_out, plan: BlockPlan, q_chunks, k_chunks, scale):
    if fused(q):
        dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (k, v))
        dq = fused_partial_backward(
            q, k, v, out, lse, grad_out, plan, q_chunks, k_chunks, scale, dk, dv
        )
        return dq, dk.to(k.dtype), dv.to(v.dtype)
    size, acc = plan.size, _accumulation_dtype(q)
    dout = grad_out.to(acc)
    delta = (dout * out.to(acc)).sum(-1)
    qs, douts = (q.to(acc) * scale).split(size, dim=2), dout.split(size, dim=2)
    lses, deltas = lse.split(size, dim=2), delta.split(size, dim=2)
    ks, vs = k.to(acc).split(size, dim=2), v.to(acc).split(size, dim=2)
    dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
    dqs, dks, dvs = (t.split(size, dim=2) for t in (dq, dk, dv))
    for a, b, mask in plan.pairs(q_chunks, k_chunks):
        dq_ab, dk_ab, dv_ab = block_backward(
            qs[a], ks[b], vs[b], douts[a], lses[a], deltas[a], mask, scale
        )
        dqs[a].add_(dq_ab)
        dks[b].add_(dk_ab)
        dvs[b].add_(dv_ab)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def add_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys plus one learned logit per head (``sinks`` ``[heads]``, gpt-oss)
    whose value is zero: ``out * sigmoid(lse - sink)`` and the log-sum-exp with the sink.
    Applied once to the result over ALL keys (after any merge), so the sink counts once."""
    sink = sinks.to(lse.dtype)[None, :, None]
    total = torch.logaddexp(lse, sink)
    kept = torch.exp(lse - total).unsqueeze(-1)
    return (out.to(lse.dtype) * kept).to(out.dtype), total


def sink_grad(
    out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """The sinks' gradient from the output and log-sum-exp that include them: the sink's
    probability times ``-rowsum(grad_out * out)``, summed over batch and queries."""
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    p_sink = torch.exp(sinks.to(lse.dtype)[None, :, None] - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


class _BlockwiseAttention(torch.autograd.Function):
    """Masked attention with an O(seq x chunk) memory forward and backward. Block math runs
    in fp32 with autocast off. With sinks, the saved output and log-sum-exp include them: the
    key gradients then follow from the same block backward (its probabilities and
    ``rowsum(grad_out * out)`` are those of the softmax with the sink)."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        plan: BlockPlan,
        q_chunks: list[int],
        k_chunks: list[int],
        scale: float,
        sinks: torch.Tensor | None,
    ):
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _forward(q, k, v, plan, q_chunks, k_chunks, scale)
            if sinks is not None:
                out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.layout = plan, q_chunks, k_chunks, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            grads = _backward(q, k, v, out, lse, grad_out, *ctx.layout)
            d_sinks = None if sinks is None else sink_grad(out, lse, grad_out, sinks)
        return *grads, None, None, None, None, d_sinks


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    q_chunks: list[int],
    k_chunks: list[int],
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` (``[batch, heads, len(q_chunks) * size, head_dim]``, its chunks the
    global chunks ``q_chunks`` in order) over ``k``/``v`` (chunks ``k_chunks``) following
    ``plan``; ``sinks`` ``[heads]``: a learned extra logit per head in every softmax (see
    :func:`add_sinks`). Every query must see at least one key (true of any causal mask:
    itself)."""
    return _BlockwiseAttention.apply(q, k, v, plan, q_chunks, k_chunks, scale, sinks)
