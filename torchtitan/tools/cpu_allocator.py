"""Training on the CPU: keep the memory that tensors free inside the process for reuse.

torch's CPU tensors are plain ``posix_memalign``/``free``. glibc serves every block above
its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and unmaps it on ``free``, and gives
the top of its heap back to the OS once more than the trim threshold is free. Each training
step then gets its logits, loss buffers and their gradients as new pages that the kernel
must fault in and zero again: about 300,000 page faults (1.2 GB) per step of the
upstream-comparison preset on one process, half the process's system time. With no mmapped
blocks and no trimming, freed memory is reused by the next step: page faults 3.1M -> 0.8M
and system time 6.3-8.9 s -> 3.6-4.7 s over a 10-step run of that preset.

The cost: freed blocks stay with the process, so its peak RSS is higher (2.28 -> 2.62 GiB
there, flat after the first step) and, as with any heap, holes between live blocks can keep
it above what is in use.

Done with ``mallopt`` through ctypes: torch has no caching allocator for CPU tensors, and
glibc reads its tunables (``GLIBC_TUNABLES``) only when a process starts, which a trainer
started by any launcher cannot rely on.
"""

from __future__ import annotations

import ctypes
import platform

import torch

from torchtitan.tools.logging import logger

# mallopt's parameter numbers, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1  # mallopt takes a C int: trimming only past 2 GiB of free heap top


def maybe_keep_freed_cpu_memory(enabled: bool, device: torch.device) -> bool:
    """Apply ``training.cpu_keep_freed_memory`` (``enabled``) for a process training on
    ``device`` (the trainer and the bare benchmark loop alike); returns whether it applied."""
    if device.type != "cpu" or not enabled:
        return False
    return keep_freed_cpu_memory()


def keep_freed_cpu_memory() -> bool:
    """Make glibc's malloc serve every block from its heap (no per-block mmap) and not give
    freed heap back to the OS below 2 GiB; returns whether it applied (glibc only; other C
    libraries keep their defaults, with an info line)."""
    if platform.libc_ver()[0] != "glibc":
        logger.info("training.cpu_keep_freed_memory: not glibc; the C allocator keeps its defaults")
        return False
    libc = ctypes.CDLL(None)
    applied = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    if applied:
        logger.info(
            "CPU allocator: freed memory stays with the process for reuse "
            "(training.cpu_keep_freed_memory)"
        )
    else:
        logger.warning(
            "training.cpu_keep_freed_memory: glibc refused mallopt; freed memory "
            "goes back to the OS as before"
        )
    return applied
