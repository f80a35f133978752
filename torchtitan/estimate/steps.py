"""The traced (fake) or measured (real) training steps: the recipe's ``train_step`` on
random batches, observed phase by phase, with pipeline schedules replayed on fake tensors."""

from __future__ import annotations

from typing import Protocol

import torch

from torchtitan.data.micro_batch import MicroBatch
from torchtitan.estimate.pipeline_replay import PipelineReplay
from torchtitan.recipe import Recipe, train_step

ITERATIONS = 2
"""Two steps: the second one runs with optimizer states and grads as in steady state."""

MAX_MICROBATCHES = 2
"""With gradient accumulation, micro-batches after the second allocate exactly what the
second does (the gradients already exist), so at most two run per step."""


def microbatches_per_step(setup: Recipe) -> int:
    return min(setup.grad_accum_steps, MAX_MICROBATCHES)


class PhaseObserver(Protocol):
    """What the estimator's trackers and probes record: phases per iteration."""

    def start_iteration(self, iteration: int) -> None: ...

    def start_microbatch(self, module: torch.nn.Module | None = None) -> None: ...

    def set_phase(self, iteration: int, phase: str) -> None: ...


class IterationObserver:
    """A ``PhaseObserver`` seen by the recipe's step as a ``StepObserver`` of one iteration."""

    def __init__(self, observer: PhaseObserver, iteration: int) -> None:
        self.observer = observer
        self.iteration = iteration

    def start_microbatch(self, module: torch.nn.Module | None = None) -> None:
        self.observer.start_microbatch(module)

    def set_phase(self, phase: str) -> None:
        self.observer.set_phase(self.iteration, phase)


def random_batch(setup: Recipe) -> MicroBatch:
    """Random tokens, one document per sequence: a document mask's blocks depend on where
    documents start, which a fake tensor cannot tell, so the estimate assumes no boundaries."""
    training = setup.job_config.training
    shape = (training.local_batch_size, training.seq_len)
    vocab_size = setup.model_args.vocab_size
    inputs = torch.randint(0, vocab_size, shape, device=setup.device)
    labels = torch.randint(0, vocab_size, shape, device=setup.device)
    return MicroBatch(inputs, labels)


def run_training_steps(
    setup: Recipe,
    observer: PhaseObserver,
    iterations: int = ITERATIONS,
    replay_pipeline: bool = False,
) -> None:
    """``replay_pipeline``: run pipeline stages through ``PipelineReplay`` (fake tensors)
    instead of the schedule."""
    replay = PipelineReplay(setup) if setup.pipeline is not None and replay_pipeline else None
    for iteration in range(1, iterations + 1):
        observer.start_iteration(iteration)
        train_step(
            setup,
            lambda: random_batch(setup),
            micro_batches=microbatches_per_step(setup),
            observer=IterationObserver(observer, iteration),
            run_microbatch=replay.microbatch_runner(iteration) if replay is not None else None,
        )
    observer.set_phase(iterations, "done")
