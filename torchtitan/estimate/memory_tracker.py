"""Memory trackers for estimation: torch's MemTracker / FSDPMemTracker plus

* a guard that ignores ops run under any fake mode other than the one active on entry
  (DTensor sharding propagation's scratch tensors, see ``emulation.private_propagation_fake_mode``);
* the step phase and innermost module at each new peak, per-phase and per-module peaks, and
  the category breakdown at each phase's peak;
* the bytes that 512-byte block rounding adds (when ``emulation.cuda_block_rounding`` is on).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _UpdateType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from torchtitan.estimate.emulation import active_fake_slot, traced_ddp_buckets

TOTAL = "Total"
ROUNDING = "Rounding"
# Module depth below the root kept in the per-module table (layers.3.feed_forward = 3).
MODULE_DEPTH = 3


@dataclass
class PeakPlace:
    iteration: int
    phase: str
    module: str | None


@dataclass
class ModuleStats:
    activations_kept: int = 0
    """Activation bytes the module's forward leaves alive (saved for its backward)."""
    peak: int = 0
    """Highest total while the module ran (forward or backward)."""


@dataclass
class TrackerResult:
    """The per-device peak, its category breakdown and where in the step it happened."""

    peak_bytes: int
    breakdown: dict[str, int]
    rounding_bytes: int
    place: PeakPlace
    phase_peaks: dict[tuple[int, str], int]
    modules: dict[str, ModuleStats] = field(default_factory=dict)
    phase_breakdowns: dict[tuple[int, str], dict[str, int]] = field(default_factory=dict)
    """Per (iteration, phase): the bytes per category when that phase's peak was set."""


class _EstimationTrackerMixin:
    """Shared additions; mixed in before MemTracker or FSDPMemTracker."""

    def _init_estimation_state(self) -> None:
        self.phase = "setup"
        self.iteration = 0
        self._fake_slot_on_entry: Any = None
        self._place = PeakPlace(0, "setup", None)
        self.phase_peaks: dict[tuple[int, str], int] = {}
        self.phase_breakdowns: dict[tuple[int, str], dict[str, int]] = {}
        self.module_stats: dict[str, ModuleStats] = {}
        self._forward_start: dict[int, int] = {}
        self._hook_handles: list[Any] = []

    def set_phase(self, iteration: int, phase: str) -> None:
        self.iteration, self.phase = iteration, phase

    def start_iteration(self, iteration: int) -> None:
        """Per-module statistics cover one iteration."""
        self.module_stats.clear()
        self.iteration = iteration

    def start_microbatch(self, module: nn.Module | None = None) -> None:
        """torch's trackers refuse a second forward of a root without a reset: forget the
        module statistics of ``module`` (a pipeline stage about to run forward; the other
        stages' backwards still need theirs), or of every module."""
        if module is None:
            self.reset_mod_stats()
            return
        for submodule in module.modules():
            self.memory_tracking.pop(submodule, None)

    # ------------------------------------------------------------ context
    def __enter__(self):
        if self._depth == 0:
            self._fake_slot_on_entry = active_fake_slot()
            self._hook_handles = [
                register_module_forward_pre_hook(self._note_forward_start),
                register_module_forward_hook(self._note_forward_end),
            ]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self._depth == 0:
            for handle in self._hook_handles:
                handle.remove()
            self._hook_handles = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if active_fake_slot() is not self._fake_slot_on_entry and not any(
            issubclass(t, DTensor) for t in types
        ):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    # ------------------------------------------------------------ bookkeeping
    def _device_snaps(self) -> dict[torch.device, dict[Any, int]]:
        """The current bytes per device, without the meta device, which holds none (QLoRA's
        base weights sit there until they are made NF4, and FSDP refers to the meta ones
        until its lazy init)."""
        return {d: snap for d, snap in self._curr_mem_snap.items() if d.type != "meta"}

    def _current_total(self) -> int:
        return sum(snap[TOTAL] for snap in self._device_snaps().values())

    def _current_breakdown(self) -> dict[str, int]:
        breakdown: dict[str, int] = {}
        for snap in self._device_snaps().values():
            for category, nbytes in _category_bytes(snap).items():
                breakdown[category] = breakdown.get(category, 0) + nbytes
        return breakdown

    def _current_activations(self) -> int:
        return sum(snap.get(self._ref_class.ACT, 0) for snap in self._device_snaps().values())

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        padding = winfo.mem_consumed - winfo.size * winfo.element_size
        previous = getattr(winfo, "_padding", 0)
        winfo._padding = padding
        delta = {
            _UpdateType.ADD: padding,
            _UpdateType.DEL: -previous,
            _UpdateType.SIZE: padding - previous,
        }.get(u_type, 0)
        snap = self._curr_mem_snap.get(winfo.device)
        if snap is not None and delta:
            snap[ROUNDING] = snap.get(ROUNDING, 0) + delta

    def _update_peak_stats(self, peak_state) -> None:
        """The global peak only: torch's version also keeps a peak snapshot per tracked module
        on every op, which nothing here reads and which took ~45% of a large trace."""
        before = dict(self._peak_mem)
        for device, snap in self._device_snaps().items():
            if self._peak_mem.get(device, 0) < snap[TOTAL]:
                self._peak_mem[device] = snap[TOTAL]
                self._peak_mem_snap[device] = copy.deepcopy(snap)
        total = self._current_total()
        key = (self.iteration, self.phase)
        if total > self.phase_peaks.get(key, -1):
            self.phase_peaks[key] = total
            self.phase_breakdowns[key] = self._current_breakdown()
        for fqn in self._mod_tracker.parents:
            stats = self.module_stats.get(fqn)
            if stats is not None and total > stats.peak:
                stats.peak = total
        if self._peak_mem != before:
            self._place = PeakPlace(self.iteration, self.phase, self._innermost_module())

    def _innermost_module(self) -> str | None:
        names = [p for p in self._mod_tracker.parents if p != "Global"]
        return _strip_root(max(names, key=lambda n: n.count("."))) if names else None

    def _note_forward_start(self, module: nn.Module, args: Any) -> None:
        fqn = self._tracked_fqn(module)
        if fqn is not None:
            self._forward_start[id(module)] = self._current_activations()
            self.module_stats.setdefault(fqn, ModuleStats())

    def _note_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        fqn = self._tracked_fqn(module)
        start = self._forward_start.pop(id(module), None)
        if fqn is not None and start is not None and not self._mod_tracker.is_bw:
            stats = self.module_stats[fqn]
            kept = self._current_activations() - start
            stats.activations_kept = max(stats.activations_kept, kept)

    def _tracked_fqn(self, module: nn.Module) -> str | None:
        fqn = self._mod_tracker.get_known_fqn(module)
        if fqn is None or fqn.count(".") > MODULE_DEPTH:
            return None
        return fqn

    def result(self) -> TrackerResult:
        real = {d: snap for d, snap in self._peak_mem_snap.items() if d.type != "meta"}
        device, snap = max(real.items(), key=lambda kv: kv[1][TOTAL])
        return TrackerResult(
            peak_bytes=snap[TOTAL],
            breakdown=_category_bytes(snap),
            rounding_bytes=snap.get(ROUNDING, 0),
            place=self._place,
            phase_peaks=dict(self.phase_peaks),
            modules={_strip_root(k): v for k, v in self.module_stats.items() if "." in k},
            phase_breakdowns=dict(self.phase_breakdowns),
        )


def _category_bytes(snap: dict[Any, int]) -> dict[str, int]:
    """A tracker snapshot's bytes by category name, without the total and the rounding tally
    (which the categories already include)."""
    return {
        (k.value if hasattr(k, "value") else str(k)): v
        for k, v in snap.items()
        if k not in (TOTAL, ROUNDING)
    }


def _strip_root(fqn: str) -> str:
    """ModTracker names modules ``<RootClass>.layers.0``; drop the root class name."""
    return fqn.split(".", 1)[1] if "." in fqn else fqn


class EstimationMemTracker(_EstimationTrackerMixin, MemTracker):
    def __init__(self) -> None:
        super().__init__()
        self._init_estimation_state()

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        """torch's version hooks every parameter's gradient, which a frozen parameter (a
        LoRA base) refuses: here only trainable parameters get the hooks."""
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if not install_grad_hooks:
            return sizes
        for param in module.parameters():
            if param.requires_grad and param not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(self._track_grad),
                    param.register_post_accumulate_grad_hook(lambda p: self._track_grad(p.grad)),
                )
        return sizes

    def _track_grad(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)


class EstimationFSDPMemTracker(_EstimationTrackerMixin, FSDPMemTracker):
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().__init__(module, optimizer)
        self._init_estimation_state()


def build_tracker(
    model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> _EstimationTrackerMixin:
    """FSDPMemTracker (sharded/unsharded params, all-gather and reduce-scatter buffers) for
    one FSDP root, otherwise MemTracker."""
    if len(model_parts) == 1 and isinstance(model_parts[0], FSDPModule) and len(optimizers) == 1:
        return EstimationFSDPMemTracker(model_parts[0], optimizers[0])
    tracker = EstimationMemTracker()
    tracker.track_external(*model_parts, *optimizers, *traced_ddp_buckets(model_parts))
    return tracker
