"""One pipeline rank's training step, replayed for the trace in its schedule's action order.

torch's schedules cannot run on fake tensors in one process: their P2P warm-up votes on a
received value and their shape inference exchanges Python objects with the other ranks. The
trace therefore runs this rank's actions itself, in the order the schedule computed
(``pipeline_order_with_comms`` for runtime schedules, ``pipeline_order`` for single-stage
ones), through the stages' own forward and backward entry points, which apply the
data-parallel handling (under FSDP: gradients stay unreduced and parameters unsharded until
the REDUCE_GRAD action). Beside the computation it allocates what torch's stage holds:

* per micro-batch, a receive buffer for the stage input (non-first stages) and one for the
  output gradient (non-last stages), allocated on the first step and kept;
* each micro-batch's stage input, output (the last stage's logits) and loss until its
  backward returns;
* what a send keeps alive: the schedules hold their send requests (which reference the
  sent tensor) until the end of the step (GPipe's backward sends, every send of the runtime
  schedules), or 1F1B until the stage's next backward has run.

Receives are no-ops (their buffers are the ones above). Validated against real schedules
on gloo (``--memory_estimation.mode measure`` under torchrun).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from torchtitan.config import ConfigError
from torchtitan.data.micro_batch import MicroBatch, model_inputs
from torchtitan.distributed.pipeline import microbatches
from torchtitan.recipe import ForwardBackward, Recipe, StepObserver
from torchtitan.tools.dtypes import TORCH_DTYPES

# Schedule action kinds (torch's _ComputationType values, a str enum).
FORWARD, FULL_BACKWARD = "F", "B"
UNSHARD, RESHARD, REDUCE_GRAD = "UNSHARD", "RESHARD", "REDUCE_GRAD"
SEND_F, SEND_B = "SEND_F", "SEND_B"
_NO_OPS = {"RECV_F", "RECV_B"}
SPLIT_BACKWARD_GAP = (
    "schedules with a split input/weight backward (torch's MemTracker cannot follow its "
    "autograd.grad; 1F1B, GPipe, Interleaved1F1B and LoopedBFS are covered)"
)


@dataclass
class _ReplayState:
    """What this rank's stages hold across actions of one step (and across steps)."""

    input_buffers: dict[int, list[torch.Tensor]]
    grad_buffers: dict[int, list[torch.Tensor]]
    forward_cache: dict[tuple[int, int], tuple[Any, Any, list[torch.Tensor]]] = field(
        default_factory=dict
    )
    backward_count: dict[int, int] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], Any] = field(default_factory=dict)
    """Input gradients computed and not yet sent (torch's ``bwd_cache``)."""
    sent: dict[int, list[Any]] = field(default_factory=dict)
    """Per stage, tensors that pending send requests keep alive."""


def stage_boundary(setup: Recipe, microbatch_size: int) -> tuple[torch.Size, torch.dtype]:
    """Shape and dtype of the activation that crosses a stage boundary: a block's output
    ``[microbatch, local sequence, dim]`` (sequence-sharded under TP's sequence parallel),
    in FSDP's compute dtype, else fp32 (autocast keeps the residual stream in fp32)."""
    pd, training = setup.parallel_dims, setup.job_config.training
    seq = training.seq_len // (pd.cp * pd.tp)
    dtype = TORCH_DTYPES[training.mixed_precision_param] if pd.fsdp_enabled else torch.float32
    return torch.Size([microbatch_size, seq, setup.model_args.dim]), dtype


def _new_state(setup: Recipe, n_micro: int) -> _ReplayState:
    shape, dtype = stage_boundary(
        setup, setup.job_config.parallelism.pipeline_parallel_microbatch_size
    )

    def buffers(requires_grad: bool) -> list[torch.Tensor]:
        return [
            torch.empty(shape, dtype=dtype, device=setup.device, requires_grad=requires_grad)
            for _ in range(n_micro)
        ]

    stages = setup.pipeline.stages
    return _ReplayState(
        input_buffers={s.stage_index: buffers(True) for s in stages if not s.is_first},
        grad_buffers={s.stage_index: buffers(False) for s in stages if not s.is_last},
    )


@dataclass(frozen=True)
class Action:
    stage_index: int
    kind: str
    microbatch_index: int | None = None


def single_stage_actions(schedule, stage_index: int, num_stages: int, n_micro: int) -> list[Action]:
    """What GPipe and 1F1B execute (their ``pipeline_order`` is drawn for visualisation and
    differs): GPipe all forwards then all backwards; 1F1B ``num_stages - stage_index``
    warm-up forwards, then a backward and a forward in turn, then the remaining backwards."""

    def f(mb: int) -> Action:
        return Action(stage_index, FORWARD, mb)

    def b(mb: int) -> list[Action]:
        backward = Action(stage_index, FULL_BACKWARD, mb)
        return [backward] if stage_index == 0 else [backward, Action(stage_index, SEND_B, mb)]

    if isinstance(schedule, ScheduleGPipe):
        order = [f(i) for i in range(n_micro)] + [a for i in range(n_micro) for a in b(i)]
    elif isinstance(schedule, Schedule1F1B):
        warmup = min(n_micro, num_stages - stage_index)
        order = [f(i) for i in range(warmup)]
        for i in range(n_micro - warmup):
            order += b(i) + [f(warmup + i)]
        order += [a for i in range(n_micro - warmup, n_micro) for a in b(i)]
    else:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: {type(schedule).__name__} is not covered by "
            "the memory estimator yet"
        )
    return order + [Action(stage_index, REDUCE_GRAD)]


def schedule_actions(setup: Recipe, n_micro: int) -> list[Action]:
    """This rank's actions in execution order; runtime (multi-stage) schedules execute their
    ``pipeline_order_with_comms``."""
    schedule = setup.pipeline.schedule
    stages = setup.pipeline.stages
    if isinstance(schedule, PipelineScheduleSingle):
        return single_stage_actions(schedule, stages[0].stage_index, stages[0].num_stages, n_micro)
    pp_rank = setup.parallel_dims.world_mesh["pp"].get_local_rank()
    return [
        Action(a.stage_index, a.computation_type.value, a.microbatch_index)  # value: a plain str
        for a in schedule.pipeline_order_with_comms[pp_rank]
        if a is not None
    ]


def _one_microbatch_actions(stage_indices: list[int]) -> list[Action]:
    return (
        [Action(s, FORWARD, 0) for s in stage_indices]
        + [Action(s, FULL_BACKWARD, 0) for s in reversed(stage_indices)]
        + [Action(s, REDUCE_GRAD) for s in stage_indices]
    )


class PipelineReplay:
    """Replays one pipeline step per call; keeps the receive buffers between steps."""

    def __init__(self, setup: Recipe) -> None:
        self.setup = setup
        self.stages = {s.stage_index: s for s in setup.pipeline.stages}
        self.n_micro = microbatches(
            setup.job_config.parallelism,
            setup.job_config.training.local_batch_size,
            next(iter(self.stages.values())).num_stages,
        )
        self.actions = schedule_actions(setup, self.n_micro)
        self.first_step_actions = _one_microbatch_actions(sorted(self.stages))
        self.state = _new_state(setup, self.n_micro)
        # 1F1B releases a backward send once the next backward has run; the others keep
        # every send request until the end of the step.
        self.sends_replace = isinstance(setup.pipeline.schedule, Schedule1F1B)
        self.kwarg_chunks: list[dict[str, torch.Tensor]] = []  # this step's, per micro-batch

    def microbatch_runner(self, iteration: int) -> ForwardBackward:
        """The recipe's ``run_microbatch`` for one iteration: the replay instead of the schedule."""

        def run(recipe: Recipe, batch: MicroBatch, observer: StepObserver) -> None:
            inputs, labels, kwargs = model_inputs(batch, recipe.parallel_dims)
            self.step(inputs, labels, kwargs, observer, iteration)

        return run

    def step(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        kwargs: dict[str, torch.Tensor],
        observer: StepObserver,
        iteration: int,
    ) -> None:
        """Step 1 only has to create the gradients and optimizer states (its peak stays
        below step 2's, which adds the optimizer states), so it runs one micro-batch per
        stage: with dozens of micro-batches that halves the trace. ``inputs`` are this
        rank's (its CP shard of every sequence); ``kwargs`` (positions under context
        parallel) reach every stage, split into micro-batches as the schedule splits them."""
        self.state.forward_cache.clear()
        self.state.backward_count.clear()
        self.state.input_grads.clear()  # step 1's were never sent
        self.state.sent.clear()
        input_chunks = inputs.tensor_split(self.n_micro)
        label_chunks = labels.tensor_split(self.n_micro)
        self.kwarg_chunks = [
            dict(zip(kwargs, chunk))
            for chunk in zip(*(value.tensor_split(self.n_micro) for value in kwargs.values()))
        ] or [{}] * self.n_micro
        with self.setup.train_context():  # one context for the step, as the trainer's
            self._run_actions(input_chunks, label_chunks, observer, iteration)
        self.state.sent.clear()

    def _run_actions(self, input_chunks, label_chunks, observer, iteration: int) -> None:
        reduced = set()
        for action in self.actions if iteration > 1 else self.first_step_actions:
            stage = self.stages[action.stage_index]
            kind = action.kind
            if kind in _NO_OPS:
                continue
            observer.set_phase(_PHASES.get(kind, kind.lower()))
            if kind == FORWARD:
                self._forward(stage, action.microbatch_index, input_chunks, label_chunks, observer)
            elif kind == FULL_BACKWARD:
                self._backward(stage, action.microbatch_index)
            elif kind in (SEND_F, SEND_B):
                self._send(stage, kind, action.microbatch_index)
            elif kind == UNSHARD:
                _each_fsdp_module(stage, lambda m: m.unshard())
            elif kind == RESHARD:
                _each_fsdp_module(stage, lambda m: m.reshard())
            elif kind == REDUCE_GRAD:
                self._reduce_grad(stage)
                reduced.add(stage.stage_index)
            else:  # I and W: split backward (zero-bubble schedules)
                raise ConfigError(
                    f"parallelism.pipeline_parallel_schedule: action {kind}: "
                    f"{SPLIT_BACKWARD_GAP} are not covered by the memory estimator yet"
                )
        for index, stage in self.stages.items():
            if index not in reduced:
                self._reduce_grad(stage)

    # ------------------------------------------------------------ actions
    def _forward(
        self, stage: PipelineStage, mb: int, input_chunks, label_chunks, observer: StepObserver
    ) -> None:
        observer.start_microbatch(stage.submod)
        x = input_chunks[mb] if stage.is_first else self.state.input_buffers[stage.stage_index][mb]
        loss = None
        output = stage.forward_maybe_with_nosync(x, **self.kwarg_chunks[mb])
        if stage.is_last:
            observer.set_phase("loss")
            loss = self.setup.loss_fn(output, label_chunks[mb])
        inputs = [x] if not stage.is_first else []
        self.state.forward_cache[(stage.stage_index, mb)] = (output, loss, inputs)
        following = self.stages.get(stage.stage_index + 1)
        if following is not None and not stage.is_last:  # V-shaped: the next stage is here
            self.state.input_buffers[following.stage_index][mb] = output.detach().requires_grad_(
                True
            )

    def _backward_inputs(self, stage: PipelineStage, mb: int) -> dict[str, Any]:
        """The backward's arguments; they keep the stage output (the last stage's logits)
        alive until the backward returns, as torch's stage does."""
        output, loss, inputs = self.state.forward_cache.pop((stage.stage_index, mb))
        if stage.is_last:
            return {
                "stage_output": loss,
                "output_grads": None,
                "input_values": inputs,
                "logits": output,
            }
        grad = self.state.grad_buffers[stage.stage_index][mb]
        return {"stage_output": (output,), "output_grads": (grad,), "input_values": inputs}

    def _backward(self, stage: PipelineStage, mb: int) -> None:
        kwargs = self._backward_inputs(stage, mb)
        count = self.state.backward_count.get(stage.stage_index, 0) + 1
        self.state.backward_count[stage.stage_index] = count
        grads, _ = stage.backward_maybe_with_nosync(
            "full", kwargs, last_backward=count == self.n_micro
        )
        self._pass_input_grad(stage, mb, grads)

    def _pass_input_grad(self, stage: PipelineStage, mb: int, grads) -> None:
        """The input gradient waits for its send or, when the previous stage is on this
        rank, becomes that stage's output gradient."""
        if stage.is_first:
            return
        previous = self.stages.get(stage.stage_index - 1)
        if previous is not None:
            self.state.grad_buffers[previous.stage_index][mb] = grads[0]
        else:
            self.state.input_grads[(stage.stage_index, mb)] = grads

    def _send(self, stage: PipelineStage, kind: str, mb: int) -> None:
        if kind == SEND_F:
            tensor = self.state.forward_cache[(stage.stage_index, mb)][0]
        else:
            tensor = self.state.input_grads.pop((stage.stage_index, mb))
        pending = self.state.sent.setdefault(stage.stage_index, [])
        if self.sends_replace:
            pending.clear()
        pending.append(tensor)

    def _reduce_grad(self, stage: PipelineStage) -> None:
        schedule = self.setup.pipeline.schedule
        stage.perform_reduce_grad(self.n_micro if schedule.scale_grads else 1)


_PHASES = {
    FORWARD: "forward",
    FULL_BACKWARD: "backward",
    REDUCE_GRAD: "reduce_grad",
    UNSHARD: "unshard",
    RESHARD: "reshard",
}


def _each_fsdp_module(stage: PipelineStage, fn) -> None:
    for module in stage.submod.modules():
        if isinstance(module, FSDPModule):
            fn(module)
