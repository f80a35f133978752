"""What runs at fixed points of every training step besides the step itself: the hang
watchdog, the rank timeline, the profiler, memory snapshots, fault tolerance's bookkeeping,
garbage collection and every debug plant. Each is a :class:`StepHook`; the trainer calls the
points of its :class:`StepHooks` in order, so its loop names none of them."""

from __future__ import annotations

from collections.abc import Iterable


class StepHook:
    """The points of a step a hook may act at (each a no-op here)."""

    def step_started(self, step: int) -> None:
        """Before the step's first batch is fetched."""

    def before_sync(self, step: int) -> None:
        """Before the step's one host sync (the non-finite / stop flags all-reduce)."""

    def step_finished(self, step: int) -> None:
        """After the optimizer step (or the decision to skip it), before validation and
        checkpointing."""

    def step_closed(self, step: int, committed: bool) -> None:
        """After validation and checkpointing; ``committed`` is False for a step that
        fault-tolerant HSDP runs again."""

    def close(self) -> None:
        """At the end of training."""


class StepHooks(StepHook):
    """Hooks called in the order given (at every point)."""

    def __init__(self, hooks: Iterable[StepHook | None]) -> None:
        self.hooks = [hook for hook in hooks if hook is not None]

    def step_started(self, step: int) -> None:
        for hook in self.hooks:
            hook.step_started(step)

    def before_sync(self, step: int) -> None:
        for hook in self.hooks:
            hook.before_sync(step)

    def step_finished(self, step: int) -> None:
        for hook in self.hooks:
            hook.step_finished(step)

    def step_closed(self, step: int, committed: bool) -> None:
        for hook in self.hooks:
            hook.step_closed(step, committed)

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()
