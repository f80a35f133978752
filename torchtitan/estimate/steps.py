"""The training steps that are traced (fake) or measured (real): the trainer's
zero_grad -> forward/loss/backward per micro-batch -> clip -> optimizer and LR step."""

from __future__ import annotations

from typing import Protocol

import torch

from torchtitan.distributed.context_parallel import shard_batch_for_cp
from torchtitan.distributed.utils import clip_grad_norm_
from torchtitan.estimate.build import TrainingSetup
from torchtitan.estimate.pipeline_replay import PipelineReplay

ITERATIONS = 2
"""Two steps: the second one runs with optimizer states and grads as in steady state."""

MAX_MICROBATCHES = 2
"""With gradient accumulation, micro-batches after the second allocate exactly what the
second does (the gradients already exist), so at most two run per step."""


def microbatches_per_step(setup: TrainingSetup) -> int:
    return min(setup.grad_accum_steps, MAX_MICROBATCHES)


class PhaseObserver(Protocol):
    def start_iteration(self, iteration: int) -> None: ...

    def start_microbatch(self, module: torch.nn.Module | None = None) -> None: ...

    def set_phase(self, iteration: int, phase: str) -> None: ...


def random_batch(setup: TrainingSetup) -> tuple[torch.Tensor, torch.Tensor]:
    training = setup.job_config.training
    shape = (training.local_batch_size, training.seq_len)
    inputs = torch.randint(0, setup.vocab_size, shape, device=setup.device)
    labels = torch.randint(0, setup.vocab_size, shape, device=setup.device)
    return inputs, labels


def _forward_backward(setup: TrainingSetup, observer: PhaseObserver, iteration: int) -> torch.Tensor:
    inputs, labels = random_batch(setup)
    positions = None
    if setup.parallel_dims.cp_enabled:  # this rank's share of every sequence, as the trainer
        inputs, labels, positions = shard_batch_for_cp(
            inputs, labels, setup.parallel_dims.world_mesh["cp"],
            setup.job_config.parallelism.context_parallel_load_balancer,
        )
    observer.start_microbatch()
    observer.set_phase(iteration, "forward")
    with setup.train_context():
        pred = setup.model(inputs, positions=positions)
        observer.set_phase(iteration, "loss")
        loss = setup.loss_fn(pred, labels)
        del pred
        observer.set_phase(iteration, "backward")
        loss.backward()
    return loss.detach()


def _pipeline_step(setup: TrainingSetup, observer: PhaseObserver, iteration: int, replay) -> None:
    """One local batch through this rank's pipeline stages: the real schedule, or on fake
    tensors its replay (``pipeline_replay``)."""
    inputs, labels = random_batch(setup)
    if replay is not None:
        replay.step(inputs, labels, observer, iteration)
        return
    pipeline = setup.pipeline
    targets = {"target": labels, "losses": []} if pipeline.has_last_stage else {}
    args = (inputs,) if pipeline.has_first_stage else ()
    observer.set_phase(iteration, "pipeline schedule")
    with setup.train_context():
        pipeline.schedule.step(*args, return_outputs=False, **targets)


def run_training_steps(
    setup: TrainingSetup, observer: PhaseObserver, iterations: int = ITERATIONS, replay_pipeline: bool = False
) -> None:
    """``replay_pipeline``: run pipeline stages through ``PipelineReplay`` (fake tensors)
    instead of the schedule."""
    params = [p for part in setup.model_parts for p in part.parameters()]
    pp_mesh = setup.parallel_dims.world_mesh["pp"] if setup.pipeline is not None else None
    replay = PipelineReplay(setup) if setup.pipeline is not None and replay_pipeline else None
    for iteration in range(1, iterations + 1):
        observer.start_iteration(iteration)
        observer.set_phase(iteration, "zero_grad")
        setup.optimizers.zero_grad()
        losses = []
        for _ in range(microbatches_per_step(setup)):
            if setup.pipeline is None:
                losses.append(_forward_backward(setup, observer, iteration))
            else:
                _pipeline_step(setup, observer, iteration, replay)
        observer.set_phase(iteration, "clip_grad_norm")
        clip_grad_norm_(params, setup.job_config.training.max_norm, foreach=True, pp_mesh=pp_mesh)
        observer.set_phase(iteration, "optimizer_step")
        setup.optimizers.step()
        setup.lr_schedulers.step()
        del losses
    observer.set_phase(iterations, "done")
