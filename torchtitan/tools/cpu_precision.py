"""Whether this CPU runs bfloat16 / float16 matmuls natively, and what a CPU run computes in.

A CPU without bf16 (or fp16) instructions (AVX2 without AVX-512 BF16 or AMX) has torch
emulate them: a bf16 matmul then runs ~80x slower than in float32 (1.3 against 143 GFLOP/s
at 512 x 512 on a 2-core AVX2 EPYC). The decision is measured (the dtype's matmul
throughput against float32's, once per machine, cached like the CPU peak) rather than read
from the capability torch reports, which is printed beside it: that string names the widest
vector unit, not whether oneDNN has bf16 kernels for it.

``resolve_cpu_precision`` applies the decision to the ``[training]`` section once, before
anything reads it, so autocast, FSDP's mixed precision, ``training.dtype``, float8
emulation's high-precision dtype, the memory estimator's CPU target and the benchmark all
follow the same choice. GPUs are never touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchtitan.tools.machine_cache import cached_measurement

if TYPE_CHECKING:
    from torchtitan.config import TrainingConfig

NATIVE_RATIO = 0.8
"""A dtype whose matmuls reach this fraction of float32's throughput counts as native (native
bf16 is 1-16x float32; emulated bf16 ~0.01x)."""

PROBE_SIZE = 512
PROBE_REPEATS = 3

_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class MatmulSpeed:
    """How fast ``dtype`` matmuls run on this CPU relative to float32."""

    dtype: torch.dtype
    ratio: float
    capability: str

    @property
    def native(self) -> bool:
        return self.ratio >= NATIVE_RATIO

    @property
    def name(self) -> str:
        return _NAMES[self.dtype]


def _best_seconds(dtype: torch.dtype) -> float:
    a = torch.randn(PROBE_SIZE, PROBE_SIZE).to(dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_ratio(dtype: torch.dtype) -> float:
    """float32 matmul time over ``dtype`` matmul time (> 1: ``dtype`` is faster)."""
    return _best_seconds(torch.float32) / _best_seconds(dtype)


def ratio_measurement_name(dtype: torch.dtype) -> str:
    """The machine cache's name for ``dtype``'s speed against float32 (kept for any thread
    count: native and emulated differ by two orders of magnitude at every count)."""
    return f"matmul {dtype} / float32 at {PROBE_SIZE}"


def matmul_speed(dtype: torch.dtype) -> MatmulSpeed:
    """``dtype``'s matmul speed against float32 on this CPU, measured once per machine."""
    ratio = cached_measurement(
        ratio_measurement_name(dtype), lambda: measure_matmul_ratio(dtype), per_thread_count=False
    )
    return MatmulSpeed(dtype, ratio, torch.backends.cpu.get_cpu_capability())


def low_precision_native(dtype: torch.dtype, device_type: str) -> bool:
    """Whether a run on ``device_type`` computes ``dtype`` matmuls natively: always on a GPU,
    measured on this CPU for a CPU run. Never asks the host about a GPU run."""
    if device_type != "cpu":
        return True
    return matmul_speed(dtype).native


_LOW_PRECISION_FIELDS = ("mixed_precision_param", "mixed_precision_reduce", "dtype")


def _requested(training: TrainingConfig) -> dict[str, torch.dtype]:
    """The ``[training]`` precision fields set to a low-precision dtype, and that dtype."""
    by_name = {name: dtype for dtype, name in _NAMES.items()}
    return {
        field: by_name[getattr(training, field)]
        for field in _LOW_PRECISION_FIELDS
        if getattr(training, field) in by_name
    }


def resolve_cpu_precision(training: TrainingConfig, device_type: str) -> str | None:
    """Apply ``training.cpu_low_precision`` to ``training`` in place for a run on
    ``device_type``; returns the one line that says what was decided and why (None when
    nothing low-precision was asked or the run is not on the CPU)."""
    requested = _requested(training)
    if device_type != "cpu" or not requested:
        return None
    speeds = {dtype: matmul_speed(dtype) for dtype in set(requested.values())}
    emulated = [speed for speed in speeds.values() if not speed.native]
    fields = ", ".join(f"training.{field}" for field in requested)
    if not emulated:
        names = " and ".join(f"{s.name} ({s.ratio:.2f}x float32)" for s in speeds.values())
        return f"CPU precision: {names} native on this CPU (measured); {fields} kept"
    slow = emulated[0]
    measured = (
        f"this CPU ({slow.capability}) runs {slow.name} matmuls at {slow.ratio:.3f}x the speed "
        f"of float32 (measured: emulated, not native)"
    )
    if training.cpu_low_precision == "force":
        return f"training.cpu_low_precision=force: {measured}; {fields} kept as configured"
    for field in requested:
        setattr(training, field, "float32")
    return (
        f"training.cpu_low_precision=auto: {measured}, so this run trains in float32 ({fields}); "
        f"--training.cpu_low_precision force keeps {slow.name}"
    )
