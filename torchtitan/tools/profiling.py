"""torch profiler traces and CUDA memory snapshots, both every ``profile_freq`` steps (each
profiler cycle: wait, ``profiler_warmup`` steps, then ``profiler_active`` recorded steps)."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch

from torchtitan.tools.logging import logger
from torchtitan.tools.step_hooks import StepHook

if TYPE_CHECKING:
    from torchtitan.config import ProfilingConfig


@contextlib.contextmanager
def maybe_enable_profiling(cfg: ProfilingConfig, dump_folder: str, global_step: int = 0):
    if not cfg.enable_profiling:
        yield None
        return
    folder = os.path.join(dump_folder, cfg.save_traces_folder)
    rank = int(os.environ.get("RANK", "0"))

    def on_trace_ready(prof) -> None:
        out = os.path.join(folder, f"iteration_{prof.step_num}")
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"rank{rank}_trace.json"))
        logger.info(f"profiler trace written to {out}")

    wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(
            wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active
        ),
        on_trace_ready=on_trace_ready,
        record_shapes=True,
    ) as prof:
        prof.step_num = global_step
        yield prof


class ProfilerSteps(StepHook):
    """Advances the torch profiler's schedule at the end of each committed step."""

    def __init__(self, profiler: torch.profiler.profile) -> None:
        self.profiler = profiler

    def step_closed(self, step: int, committed: bool) -> None:
        if committed:
            self.profiler.step()


class MemorySnapshotter(StepHook):
    """Dumps CUDA allocator history every profile_freq committed steps."""

    def __init__(self, folder: str, freq: int) -> None:
        self.folder, self.freq = folder, freq
        torch.cuda.memory._record_memory_history(max_entries=100_000)

    def step_closed(self, step: int, committed: bool) -> None:
        if not committed or step % self.freq != 0:
            return
        out = os.path.join(self.folder, f"iteration_{step}")
        os.makedirs(out, exist_ok=True)
        name = f"rank{os.environ.get('RANK', '0')}_memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(os.path.join(out, name))


def maybe_memory_snapshotter(
    cfg: ProfilingConfig, dump_folder: str, device: torch.device
) -> MemorySnapshotter | None:
    if not cfg.enable_memory_snapshot:
        return None
    if device.type != "cuda":
        logger.warning("profiling.enable_memory_snapshot needs CUDA; no snapshots on this device")
        return None
    return MemorySnapshotter(
        os.path.join(dump_folder, cfg.save_memory_snapshot_folder), cfg.profile_freq
    )
