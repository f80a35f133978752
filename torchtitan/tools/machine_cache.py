"""Measurements of this machine's CPU (matmul peaks, the bf16 / fp16 speed against fp32), taken
once and kept on disk under ``$TORCHTITAN_CACHE`` (default ``~/.cache/torchtitan``).

An entry is keyed by what decides the measured value: the CPU model and the instruction-set
flags that decide low-precision matmul speed (a home folder shared by machines of different
CPU kinds must not hand one kind's measurement to the other), the core count, the torch
version, and the thread count where the value depends on it. The folder is read from the
environment at each call, so a test session (and every process it launches) can point it at a
temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

CACHE_ENV = "TORCHTITAN_CACHE"

# The flags that decide whether bf16 / fp16 matmuls run natively (oneDNN picks its kernels by
# them); the vector width alone (torch's reported CPU capability) does not say it.
_PRECISION_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)


def cache_folder() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "torchtitan")


@cache
def cpu_identity() -> str:
    """The CPU model and its low-precision flags (from /proc/cpuinfo on Linux, where
    ``platform.processor()`` is empty), the architecture and the core count."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    named = ",".join(flag for flag in _PRECISION_FLAGS if flag in flags)
    return f"{model}|{named}|{platform.machine()}|{os.cpu_count()}"


def measurement_path(name: str, per_thread_count: bool = True) -> Path:
    """The file that holds measurement ``name`` of this machine."""
    threads = torch.get_num_threads() if per_thread_count else "any"
    source = f"{cpu_identity()}|{threads}|{torch.__version__}|{name}"
    return cache_folder() / f"cpu_{hashlib.sha1(source.encode()).hexdigest()[:16]}.json"


def record_measurement(name: str, value: float, per_thread_count: bool = True) -> Path:
    """Write ``value`` as this machine's measurement ``name`` (atomically: a reader sees the
    old file or the new one)."""
    path = measurement_path(name, per_thread_count)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"value": value, "name": name, "machine": cpu_identity()}))
    tmp.replace(path)
    return path


def cached_measurement(
    name: str, measure: Callable[[], float], per_thread_count: bool = True
) -> float:
    """``measure()`` once per machine, then read from the cache; a lock file keeps concurrent
    ranks from all measuring at once."""
    path = measurement_path(name, per_thread_count)
    cached = _read_value(path)
    if cached is not None:
        return cached
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_suffix(".lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        for _ in range(200):  # another rank is measuring: wait for its result
            time.sleep(0.1)
            cached = _read_value(path)
            if cached is not None:
                return cached
        return measure()
    try:
        value = measure()
        record_measurement(name, value, per_thread_count)
        return value
    finally:
        os.close(fd)
        lock.unlink(missing_ok=True)


def _read_value(path: Path) -> float | None:
    try:
        return float(json.loads(path.read_text())["value"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
