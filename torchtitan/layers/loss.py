"""Training losses.

A train spec's loss (``build_loss_fn``) returns the SUM of the per-token losses over the
labels that are not :data:`IGNORE_INDEX`. The recipe divides it by the number of such labels
in the whole global batch (:class:`GlobalTokenMeanLoss`), so the gradient is the one of a
single big batch however the tokens fall into micro-batches, ranks and pipeline micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

IGNORE_INDEX = -100
"""A label that contributes nothing to the loss (prompt tokens, padding)."""


def cross_entropy_sum(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the valid labels, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the valid labels of one batch (for direct use; training
    normalises over the global batch instead)."""
    return F.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX
    )


def build_cross_entropy_loss() -> LossFn:
    """The train specs' ``build_loss_fn``: the summed cross-entropy."""
    return cross_entropy_sum


def valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many labels count in the loss (a 0-dim int64 tensor on the labels' device)."""
    return (labels != IGNORE_INDEX).sum()


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position ``[batch, seq]`` in fp32, 0 where the label is ignored."""
    flat = F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(0, 1),
        reduction="none",
        ignore_index=IGNORE_INDEX,
    )
    if isinstance(flat, DTensor):  # loss parallel: every tensor-parallel rank holds it whole
        flat = flat.full_tensor()
    return -flat.view(labels.shape)


class GlobalTokenMeanLoss:
    """``loss_sum(pred, labels) / divisor``, the divisor set once per step.

    Gradient reductions (FSDP, HSDP, DDP) average over the ``data_ranks`` ranks that hold
    different tokens (dp x cp), so each rank divides by ``global valid tokens / data_ranks``:
    the averaged gradient is then the sum over all tokens divided by their number. With the
    divisor unset (``None``) the loss is the plain sum (validation).
    """

    def __init__(self, loss_sum: LossFn) -> None:
        self.loss_sum = loss_sum
        self.divisor: torch.Tensor | None = None

    def set_global_tokens(self, tokens: torch.Tensor | None, data_ranks: int = 1) -> None:
        """``tokens``: valid labels of the whole global batch; None: sum, do not divide."""
        self.divisor = None if tokens is None else tokens.clamp(min=1) / data_ranks

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss_sum(pred, labels)
        return loss if self.divisor is None else loss / self.divisor


# ---------------------------------------------------------------------------- chunked
MIN_AUTO_CHUNK = 1024
"""The fewest tokens an automatic chunk takes: shorter matmuls run below the device's rate
and every chunk adds its weight gradient to the fp32 sum once more (on an H200, Llama 3 1B
at 16,384 tokens per micro-batch lost 17 % of its tokens/s with 256-token chunks)."""


def auto_chunk_tokens(tokens: int, vocab_local: int, dim: int) -> int:
    """Tokens per chunk when ``training.loss_chunk_size`` is -1: ``ceil(vocab / dim)``
    chunks, so that one chunk's logits take about as many values as the hidden states (Liger
    Kernel's rule), but at least :data:`MIN_AUTO_CHUNK` tokens (and at most ``tokens``)."""
    chunks = max(1, math.ceil(vocab_local / dim))
    return min(tokens, max(MIN_AUTO_CHUNK, math.ceil(tokens / chunks)))


def _tp_shard(weight: torch.Tensor) -> tuple[torch.Tensor, int, dist.ProcessGroup | None]:
    """(local rows, first vocabulary id of this rank, the tensor-parallel group) of an output
    weight: a plain tensor, or a DTensor sharded on the vocabulary over one mesh dimension."""
    if not isinstance(weight, DTensor):
        return weight, 0, None
    (placement,) = weight.placements
    if not (isinstance(placement, Shard) and placement.dim == 0):
        return weight.to_local(), 0, None  # replicated: every rank scores the whole vocabulary
    mesh = weight.device_mesh
    rows = math.ceil(weight.shape[0] / mesh.size())  # torch.chunk's split, as DTensor's
    return weight.to_local(), mesh.get_local_rank() * rows, mesh.get_group()


def _combine_over_vocab_shards(
    lse: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-sum-exp over the whole vocabulary from each rank's shard, and the target
    logit from the rank that holds it: two all-reduces of [tokens] values per forward."""
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    packed = torch.stack([torch.exp(lse - top), target])
    dist.all_reduce(packed, group=group)
    return top + torch.log(packed[0]), packed[1]


def _logsumexp_(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp(logits, -1)`` computed in the logits' own storage (overwritten): one chunk
    of logits is the loss's largest tensor, ``torch.logsumexp`` would add two more."""
    top = logits.amax(dim=-1, keepdim=True)
    return top.squeeze(1) + logits.sub_(top).exp_().sum(dim=-1).log_()


def upcasts_matmuls(device: torch.device) -> bool:
    """Whether the weight gradient's low-precision matmuls run in fp32 on ``device``: on the
    CPU (most CPUs emulate bf16 matmuls), not on CUDA. The memory estimator's CUDA emulation
    overrides it, its traced tensors being on the CPU."""
    return device.type == "cpu"


def _add_weight_grad(grad_w: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_w += grad_logits.T @ h``, summed in ``grad_w``'s dtype (fp32 for low-precision
    inputs), multiplied in fp32 where :func:`upcasts_matmuls`, else in the inputs' dtype."""
    if grad_w.dtype == h.dtype:
        grad_w.addmm_(grad_logits.T, h)
    elif upcasts_matmuls(grad_w.device):
        grad_w.addmm_(grad_logits.T.float(), h.float())
    else:
        grad_w += grad_logits.T @ h


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``h @ weight.T`` (scored in fp32, or fp64 for fp64 inputs)
    one chunk of tokens at a time, without the logits: the forward keeps each token's
    log-sum-exp, the backward recomputes a chunk's logits and turns them into that chunk's
    hidden-state and weight gradients. ``weight`` may be one vocabulary shard (first id
    ``vocab_start``) of a tensor-parallel ``group``. Written here: torch has no fused linear
    cross-entropy, and Liger Kernel's (CUDA only) knows no vocabulary shards."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk, vocab_start, group):
        local = labels - vocab_start
        in_shard = (local >= 0) & (local < weight.shape[0]) & (labels != IGNORE_INDEX)
        index = torch.where(in_shard, local, 0).unsqueeze(1)
        score_dtype = torch.promote_types(h.dtype, torch.float32)
        lse = torch.empty(h.shape[0], dtype=score_dtype, device=h.device)
        target = torch.empty_like(lse)
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (h[rows] @ weight.T).to(score_dtype)
            target[rows] = logits.gather(1, index[rows]).squeeze(1)
            lse[rows] = _logsumexp_(logits)
            del logits
        target = torch.where(in_shard, target, 0.0)
        if group is not None:
            lse, target = _combine_over_vocab_shards(lse, target, group)
        valid = labels != IGNORE_INDEX
        ctx.save_for_backward(h, weight, lse, index, in_shard, valid)
        ctx.chunk = chunk
        return torch.where(valid, lse - target, 0.0).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, lse, index, in_shard, valid = ctx.saved_tensors
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            # summed over the chunks in fp32 (or fp64): a bf16 sum of many chunks would lose
            # what the full path's one matmul keeps
            grad_w = weight.new_zeros(weight.shape, dtype=lse.dtype)
        row_scale = valid.to(lse.dtype) * grad_loss.to(lse.dtype)
        for start in range(0, h.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            grad_logits = (h[rows] @ weight.T).to(lse.dtype).sub_(lse[rows, None]).exp_()
            grad_logits.scatter_add_(1, index[rows], -in_shard[rows, None].to(lse.dtype))
            grad_logits = grad_logits.mul_(row_scale[rows, None]).to(h.dtype)
            if grad_h is not None:
                torch.mm(grad_logits, weight, out=grad_h[rows])
            if grad_w is not None:
                _add_weight_grad(grad_w, grad_logits, h[rows])
            del grad_logits
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def chunked_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Summed cross-entropy over the valid labels of ``h @ weight.T`` (``h`` [..., dim],
    ``labels`` [...]), ``chunk`` tokens at a time. ``weight`` may be a DTensor sharded on the
    vocabulary (tensor parallel: each rank scores its shard, the log-sum-exp is combined over
    the group) and ``h`` a DTensor sharded on the sequence (gathered once here)."""
    if isinstance(h, DTensor):
        # The gradient of the gathered h is partial (each rank's vocabulary shard adds its
        # share): reduce-scattered back onto the sequence shards.
        h = h.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    local_weight, vocab_start, group = _tp_shard(weight)
    device_type = h.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else h.dtype
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            h.flatten(0, -2).to(dtype),
            local_weight.to(dtype),
            labels.flatten(),
            chunk,
            vocab_start,
            group,
        )


class LinearCrossEntropy:
    """``loss_sum(h, labels)`` for a decoder that returns its final hidden states: the output
    projection (``bind``) and the summed cross-entropy together, ``chunk_size`` tokens at a
    time (-1: :func:`auto_chunk_tokens`), so the logits never exist whole. ``kernel`` "liger":
    Liger Kernel's fused linear cross-entropy (CUDA, no tensor parallel)."""

    def __init__(self, chunk_size: int, kernel: str = "native") -> None:
        self.chunk_size = chunk_size
        self.liger = _liger_loss() if kernel == "liger" else None
        self.output: nn.Linear | None = None

    def bind(self, output: nn.Linear) -> None:
        """The output layer whose weight projects (read at every call: FSDP swaps it)."""
        self.output = output

    def chunk_tokens(self, tokens: int, weight: torch.Tensor) -> int:
        if self.chunk_size > 0:
            return self.chunk_size
        local_vocab = weight.to_local().shape[0] if isinstance(weight, DTensor) else weight.shape[0]
        return auto_chunk_tokens(tokens, local_vocab, weight.shape[1])

    def __call__(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weight = self.output.weight
        if self.liger is not None:
            return self.liger(weight, h.flatten(0, -2), labels.flatten())
        return chunked_linear_cross_entropy(
            h, weight, labels, self.chunk_tokens(labels.numel(), weight)
        )


def _liger_loss() -> nn.Module:
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss,
    )

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
