"""Peak FLOP/s (GPU data sheets, the measured CPU matmul peak) and peak memory: what MFU
and the memory figures divide by."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import torch

from torchtitan.tools.logging import logger
from torchtitan.tools.machine_cache import cached_measurement

# Dense bf16 peak FLOP/s per device (no sparsity), from vendor data sheets.
_GPU_PEAK_BF16 = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H20", 148e12),
    ("B200", 2.25e15),
    ("GB200", 2.5e15),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
    ("MI250X", 191.5e12),
]


def gpu_peak_flops(device_name: str) -> float | None:
    for key, flops in _GPU_PEAK_BF16:
        if key in device_name:
            return flops
    return None


def cpu_peak_flops(dtype: torch.dtype = torch.float32) -> float:
    """Measured matmul peak of this machine for ``dtype`` with the current thread count."""
    return cached_measurement(f"matmul peak {dtype}", lambda: measure_matmul_flops(dtype))


def measure_matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 8) -> float:
    """Best-of-``repeats`` FLOP/s of an ``[n, n] @ [n, n]`` matmul in ``dtype`` on the CPU."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@dataclass(frozen=True)
class PeakFlops:
    """The peak MFU divides by, and where it comes from (for the one line at start)."""

    flops: float
    source: str


def peak_flops(device: torch.device, dtype: torch.dtype) -> PeakFlops:
    """The matmul peak of ``device`` in ``dtype`` (the dtype the matmuls run in)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        flops = gpu_peak_flops(name)
        if flops is None:
            logger.warning(f"peak FLOPs of {name!r} unknown; MFU assumes A100 (312 TFLOP/s)")
            return PeakFlops(312e12, "A100 bf16 data sheet (device unknown)")
        if dtype in (torch.bfloat16, torch.float16):
            return PeakFlops(flops, f"{name} bf16 data sheet")
        return PeakFlops(flops / 2, f"{name} bf16 data sheet / 2 for {dtype}")
    threads = torch.get_num_threads()
    return PeakFlops(
        cpu_peak_flops(dtype),
        f"{dtype} matmul peak of this CPU measured with {threads} thread{'s' * (threads > 1)}",
    )


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or peak process RSS (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
