"""Garbage collection at fixed steps: automatic collection's pauses come at different times
on different ranks and desynchronise them."""

from __future__ import annotations

import gc

from torchtitan.tools.step_hooks import StepHook


class GarbageCollection(StepHook):
    """Disable automatic GC and collect every ``gc_freq`` steps (every step with ``debug``:
    a full collection)."""

    def __init__(self, gc_freq: int = 50, debug: bool = False) -> None:
        self.gc_freq = gc_freq
        self.debug = debug
        gc.disable()
        gc.collect(1)

    def step_started(self, step: int) -> None:
        if self.debug:
            gc.collect()
        elif step > 1 and step % self.gc_freq == 0:
            gc.collect(1)

    def close(self) -> None:
        gc.enable()
