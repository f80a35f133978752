"""``torch._grouped_mm`` behind a custom op, for compiled experts outside bf16.

torch's fake kernel of ``_grouped_mm`` (2.11 to 2.13) accepts bf16 inputs only, while its
eager kernels (CPU, CUDA's fallback) take fp32 too; so a compiled fp32 MoE block could not
trace the experts. This op runs the same eager kernel with a fake kernel of its own and its
gradients through the same op, so the compiled graph keeps no host sync and eager numerics.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("torchtitan::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a`` [rows, k] x ``b`` [groups, k, n] -> [rows, n], rows of group g in
    ``offs[g-1]:offs[g]``; or ``a`` [k, rows] x ``b`` [rows, n] -> [groups, k, n] (the
    weight gradient's form)."""
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    a, b, offs = inputs
    if b.dim() != 3:
        raise NotImplementedError("torchtitan::grouped_mm differentiates its 2-D x 3-D form only")
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad: torch.Tensor) -> tuple:
    a, b, offs = ctx.saved_tensors
    grad_a = grouped_mm(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm(a.t(), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
