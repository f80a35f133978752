"""The measured side of ``mode measure``: the same training steps on real tensors.

On CPU the peak is taken two independent ways at allocation level: the tracker on real
tensors, and the CPU allocator's events from the profiler (live bytes at the start plus the
running sum of allocations and frees). On CUDA it is ``torch.cuda.max_memory_allocated``.

Under pipeline parallel torch's schedule runs for real, measured by the allocator events
only (torch's MemTracker cannot follow the schedule's first-step shape inference); the
trace's replay of the schedule (``pipeline_replay``) then runs once more on real tensors,
measured both ways: the tracker checks the fake trace, the allocator events the replay.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtitan.estimate.build import TrainingBuild
from torchtitan.estimate.memory_tracker import TrackerResult, build_tracker
from torchtitan.estimate.steps import run_training_steps
from torchtitan.recipe import Recipe

INIT_SEED = 0


@dataclass
class MeasuredOutcome:
    peak_bytes: int
    """The primary measure: the profiler's allocator peak on CPU, max_memory_allocated on CUDA."""
    method: str
    tracker: TrackerResult | None = None
    reserved_bytes: int | None = None
    phase_peaks: dict[tuple[int, str], int] = field(default_factory=dict)
    replayed: MeasuredOutcome | None = None
    """Under pipeline parallel on CPU: the replayed schedule on real tensors."""


class NoPhases:
    """A phase observer that records nothing."""

    def start_iteration(self, iteration: int) -> None:
        pass

    def start_microbatch(self, module: nn.Module | None = None) -> None:
        pass

    def set_phase(self, iteration: int, phase: str) -> None:
        pass


class CudaPhaseProbe:
    """Per-phase ``max_memory_allocated`` (the peak counter is reset at each phase change)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phase_peaks: dict[tuple[int, str], int] = {}
        self._current: tuple[int, str] = (0, "setup")

    def start_iteration(self, iteration: int) -> None:
        pass

    def start_microbatch(self, module: nn.Module | None = None) -> None:
        pass

    def set_phase(self, iteration: int, phase: str) -> None:
        torch.cuda.synchronize(self.device)
        self.phase_peaks[self._current] = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._current = (iteration, phase)


def live_storage_bytes(
    model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> int:
    """Bytes of the distinct storages behind parameters, buffers, grads and optimizer state."""
    params = [p for part in model_parts for p in part.parameters()]
    tensors = params + [b for part in model_parts for b in part.buffers()]
    tensors += [p.grad for p in params if p.grad is not None]
    tensors += [
        v
        for opt in optimizers
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    ]
    storages = {}
    for t in tensors:
        for plain in _plain_tensors(t.to_local() if hasattr(t, "to_local") else t):
            storage = plain.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``, or the inner tensors that hold the bytes of a wrapper subclass (an NF4 base)."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [plain for name in names for plain in _plain_tensors(getattr(t, name))]


def _allocator_peak(prof: profile) -> int:
    """Highest running sum of the CPU allocator's alloc/free events."""
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    return peak


def _measure_cpu(setup: Recipe, replay_pipeline: bool = False) -> MeasuredOutcome:
    optimizers = list(setup.optimizers)
    gc.collect()
    baseline = live_storage_bytes(setup.model_parts, optimizers)
    method = "CPU allocator events (torch.profiler profile_memory)"
    if setup.pipeline is not None and not replay_pipeline:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run_training_steps(setup, NoPhases())
        return MeasuredOutcome(peak_bytes=baseline + _allocator_peak(prof), method=method)
    tracker = build_tracker(setup.model_parts, optimizers)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, tracker:
        run_training_steps(setup, tracker, replay_pipeline=replay_pipeline)
    result = tracker.result()
    return MeasuredOutcome(
        peak_bytes=baseline + _allocator_peak(prof),
        method=method,
        tracker=result,
        phase_peaks=result.phase_peaks,
    )


def _measure_cuda(setup: Recipe) -> MeasuredOutcome:
    probe = CudaPhaseProbe(setup.device)
    torch.cuda.synchronize(setup.device)
    torch.cuda.reset_peak_memory_stats(setup.device)
    run_training_steps(setup, probe)
    stats = torch.cuda.memory_stats(setup.device)
    peaks = {k: v for k, v in probe.phase_peaks.items() if k[1] != "setup"}
    return MeasuredOutcome(
        peak_bytes=max(peaks.values()),
        method="torch.cuda.max_memory_allocated",
        reserved_bytes=stats.get("reserved_bytes.all.peak"),
        phase_peaks=peaks,
    )


def measure_training_memory(build: TrainingBuild, device: torch.device) -> MeasuredOutcome:
    """Run the steps for real on this rank (the default process group must exist, of
    ``build.world_size`` ranks; ``device`` of the build's target type)."""
    build = build.resolved_for(device.type)
    parallel_dims = build.parallel_dims(device.type)
    setup = build.recipe(parallel_dims, device, seed=INIT_SEED)
    if device.type == "cuda":
        return _measure_cuda(setup)
    measured = _measure_cpu(setup)
    if setup.pipeline is not None:
        del setup
        replay_setup = build.recipe(parallel_dims, device, seed=INIT_SEED)
        measured.replayed = _measure_cpu(replay_setup, replay_pipeline=True)
    return measured
