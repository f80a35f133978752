"""What makes a fake-tensor trace of training match a real device's allocations.

* a fake process group, so one process can be any rank of any world size;
* a tracker guard against DTensor sharding propagation, whose global-shape scratch tensors
  would otherwise be counted as real memory (torch reuses the caller's FakeTensorMode for it);
* the CUDA caching allocator's 512-byte block rounding, applied to the traced CPU storages;
* emulation of CUDA kernels whose saved-for-backward tensors differ from the CPU kernels'
  (the fused rms_norm saves the input and an fp32 rstd; the CPU decomposition saves fp32 copies);
* MoE routing without values: perfectly balanced token counts, the routing the estimate
  assumes, and the grouped_mm capability of the target;
* DDP's gradient buckets in place of its C++ reducer, which cannot run on fake tensors.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.distributed.tensor import DTensor

CUDA_BLOCK_BYTES = 512


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """The default process group is the "fake" backend: collectives return at once and every
    buffer still has its true per-rank size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def private_propagation_fake_mode() -> Iterator[None]:
    """Make DTensor sharding propagation use its own FakeTensorMode instead of ours, so that
    the tracker guard can tell its scratch tensors from the traced program's."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


def active_fake_slot() -> Any:
    """The FakeTensorMode currently in the dispatcher's FAKE slot (None outside fake mode)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


@contextlib.contextmanager
def cuda_block_rounding() -> Iterator[None]:
    """Round every tracked storage up to the CUDA caching allocator's 512-byte blocks, whatever
    device the traced tensors are on (the trackers only do it for device type cuda)."""
    from torch.distributed._tools import mem_tracker

    info_cls = mem_tracker._WeakRefInfo
    original = info_cls._calculate_mem_consumed

    def rounded(self) -> int:
        return math.ceil(self.size * self.element_size / CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES

    info_cls._calculate_mem_consumed = rounded
    try:
        yield
    finally:
        info_cls._calculate_mem_consumed = original


class _FusedRMSNormAllocations(torch.autograd.Function):
    """Allocates what CUDA's ``_fused_rms_norm`` allocates and saves: the output, an fp32 rstd
    per row; backward allocates the input and weight gradients. Values are not computed, so
    this is only used on fake tensors."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor | None, n_norm_dims: int
    ) -> torch.Tensor:
        rstd = x.new_empty(
            x.shape[: x.dim() - n_norm_dims] + (1,) * n_norm_dims, dtype=torch.float32
        )
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, _rstd, weight = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[1] else None
        )
        return grad_x, grad_w, None


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _cuda_like_rms_norm(x: torch.Tensor, normalized_shape, weight=None, eps=None) -> torch.Tensor:
    out = _FusedRMSNormAllocations.apply(_local(x), _local(weight), len(normalized_shape))
    if isinstance(x, DTensor):
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
    return out


# functional name -> allocation-only emulation of its CUDA kernel. Patched on the module
# (not through a TorchFunctionMode, which the autograd engine does not carry into
# activation-checkpoint recomputation). Extend as CPU and CUDA kernels diverge.
_EMULATED_FUNCTIONALS = {"rms_norm": _cuda_like_rms_norm}


@contextlib.contextmanager
def cuda_kernel_emulation() -> Iterator[None]:
    """Route the functionals whose CPU and CUDA kernels save different tensors for backward
    to an emulation of the CUDA kernel's allocations, ring attention to the block math it
    runs on CUDA (the fused path is the CPU's flash kernel), and the chunked loss's weight
    gradient to CUDA's matmuls in the inputs' dtype (the CPU's upcasts them to fp32)."""
    from torchtitan.distributed.context_parallel import attention as context_parallel
    from torchtitan.layers import loss

    originals = {name: getattr(F, name) for name in _EMULATED_FUNCTIONALS}
    for name, replacement in _EMULATED_FUNCTIONALS.items():
        setattr(F, name, replacement)
    ring_fused, upcasts = context_parallel.fused, loss.upcasts_matmuls
    context_parallel.fused = lambda q: False
    loss.upcasts_matmuls = lambda device: False
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(F, name, original)
        context_parallel.fused, loss.upcasts_matmuls = ring_fused, upcasts


def balanced_host_counts(counts: torch.Tensor, rows: int) -> list:
    """``layers.moe.host_counts`` during a trace. Fake tensors have no values: every row
    of ``counts`` is a perfectly balanced split of ``rows``. Real tensors (the grouped_mm
    probe's) report their own counts."""
    if not is_fake(counts):
        return counts.tolist()
    base, extra = divmod(rows, counts.shape[-1])
    row = [base + (1 if i < extra else 0) for i in range(counts.shape[-1])]
    return row if counts.dim() == 1 else [list(row) for _ in range(counts.shape[0])]


def _fake_grouped_mm_accepts(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's meta kernel for ``_grouped_mm`` takes bf16 only, while the CPU kernel also
    runs fp32: a trace in fp32 then counts the expert loop instead, whose saved tensors are
    the same per token. (torch logs the meta kernel's refusal with its whole traceback before
    raising it; the question is expected to fail, so that log is silenced.)"""
    x = torch.zeros(4, 8, device=device, dtype=dtype)
    w = torch.zeros(2, 8, 8, device=device, dtype=dtype)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        torch._grouped_mm(x, w, offs=torch.tensor([2, 4], device=device, dtype=torch.int32))
    except RuntimeError:
        return False
    finally:
        fake_log.setLevel(level)
    return True


@contextlib.contextmanager
def balanced_moe_routing(target: str) -> Iterator[None]:
    """MoE layers traced on fake tensors: token counts read on the host (the expert loop's
    and expert parallel's splits) come out balanced, and the grouped_mm capability is the
    target's: for a CPU target the probe runs on real tensors of this CPU (its comparison
    needs values); a CUDA target has grouped GEMMs and this host is not asked."""
    from torchtitan.layers import moe

    host_counts, probe = moe.host_counts, moe.grouped_mm_works

    def target_capability(device: torch.device, dtype: torch.dtype, *shape: int) -> bool:
        if target == "cuda":
            works = True
        else:
            with unset_fake_temporarily():
                works = probe(device, dtype, *shape)
        return works and _fake_grouped_mm_accepts(device, dtype)

    moe.host_counts, moe.grouped_mm_works = balanced_host_counts, target_capability
    try:
        yield
    finally:
        moe.host_counts, moe.grouped_mm_works = host_counts, probe


_DDP_BUCKET_SIZES: weakref.WeakKeyDictionary[nn.Module, list[tuple[int, torch.dtype]]] = (
    weakref.WeakKeyDictionary()
)
_DDP_BUCKETS: weakref.WeakKeyDictionary[nn.Module, list[torch.Tensor]] = weakref.WeakKeyDictionary()


def ddp_bucket_sizes(module: nn.Module, bucket_cap_mb: float) -> list[tuple[int, torch.dtype]]:
    """The buckets DDP's reducer allocates when it wraps ``module`` (elements, dtype): flat
    buffers that together hold every trainable parameter's gradient (in reverse registration
    order, the first bucket ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, the others
    ``bucket_cap_mb``), alive for the whole run. Gradients are copied in, all-reduced in
    place and copied back out."""
    params = [p for p in module.parameters() if p.requires_grad][::-1]
    buckets, current, cap = [], [], dist._DEFAULT_FIRST_BUCKET_BYTES
    for param in params:
        current.append(param)
        if sum(p.numel() * p.element_size() for p in current) >= cap:
            buckets.append(current)
            current, cap = [], int(bucket_cap_mb * 2**20)
    buckets += [current] if current else []
    return [(sum(p.numel() for p in group), group[0].dtype) for group in buckets]


@contextlib.contextmanager
def ddp_bucket_allocations() -> Iterator[None]:
    """DDP (``replicate``) traced on fake tensors: its C++ reducer reads tensor data and needs
    a real process group for its gradient hook, so the trace allocates its buckets instead
    (:func:`ddp_bucket_sizes`, once the model is materialised: :func:`traced_ddp_buckets`;
    the all-reduce allocates nothing more)."""
    from torchtitan.distributed import data_parallel

    original = data_parallel.replicate

    def replicate_allocations(module: nn.Module, device_mesh, bucket_cap_mb: float) -> nn.Module:
        _DDP_BUCKET_SIZES[module] = ddp_bucket_sizes(module, bucket_cap_mb)
        return module

    data_parallel.replicate = replicate_allocations
    try:
        yield
    finally:
        data_parallel.replicate = original


def traced_ddp_buckets(model_parts: list[nn.Module]) -> list[torch.Tensor]:
    """The DDP buckets of these (materialised) model parts, allocated on their device and kept
    alive with the part."""
    for part in model_parts:
        if part in _DDP_BUCKET_SIZES and part not in _DDP_BUCKETS:
            device = next(part.parameters()).device
            _DDP_BUCKETS[part] = [
                torch.empty(numel, dtype=dtype, device=device)
                for numel, dtype in _DDP_BUCKET_SIZES[part]
            ]
    return [bucket for part in model_parts for bucket in _DDP_BUCKETS.get(part, [])]
