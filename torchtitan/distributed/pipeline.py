"""Pipeline parallel: split a model into stages, place them on the ``pp`` ranks and build a
``torch.distributed.pipelining`` schedule.

Stages keep the FQNs of the unsplit model (layers live in a ModuleDict keyed by layer id and
a stage only deletes what it does not hold), so checkpoints load across pipeline degrees.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    _PipelineScheduleRuntime,
    get_schedule_class,
)

from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

SCHEDULES = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]
_V_SHAPED = (ScheduleZBVZeroBubble, ScheduleDualPipeV)


@dataclass
class StagePlan:
    """Which stages exist and which layers each holds."""

    num_stages: int
    layers: list[list[int]]  # layer ids per stage
    v_shaped: bool

    def stages_of_rank(self, pp_rank: int, pp_degree: int) -> list[int]:
        per_rank = self.num_stages // pp_degree
        if self.v_shaped:
            return [pp_rank, self.num_stages - 1 - pp_rank]
        return [pp_rank + k * pp_degree for k in range(per_rank)]


def schedule_class(name: str, csv: str = "") -> type:
    if csv:
        return _PipelineScheduleRuntime
    try:
        return get_schedule_class(name)
    except ValueError:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: unknown schedule {name!r}; valid: "
            f"{', '.join(SCHEDULES)} (or a CSV file via pipeline_parallel_schedule_csv)"
        ) from None


def plan_stages(parallelism: ParallelismConfig, n_layers: int, pp_degree: int) -> StagePlan:
    """Decide the stages from split points, layers per stage, or an even split in which the
    embedding and the output count as ``first/last_stage_less_layers`` layers each."""
    p = parallelism
    cls = schedule_class(p.pipeline_parallel_schedule, p.pipeline_parallel_schedule_csv)
    multi = issubclass(cls, PipelineScheduleMulti)
    v_shaped = issubclass(cls, _V_SHAPED)
    if p.pipeline_parallel_split_points:
        layers = _layers_from_split_points(p.pipeline_parallel_split_points, n_layers)
    else:
        slots = (
            p.pipeline_parallel_first_stage_less_layers
            + n_layers
            + p.pipeline_parallel_last_stage_less_layers
        )
        if p.pipeline_parallel_layers_per_stage is not None:
            num_stages = math.ceil(slots / p.pipeline_parallel_layers_per_stage)
        else:
            num_stages = pp_degree * (2 if multi else 1)
        layers = _even_split(
            n_layers,
            num_stages,
            p.pipeline_parallel_first_stage_less_layers,
            p.pipeline_parallel_last_stage_less_layers,
        )
    plan = StagePlan(len(layers), layers, v_shaped)
    _check_plan(plan, pp_degree, multi, v_shaped, p.pipeline_parallel_schedule)
    return plan


def _layers_from_split_points(split_points: list[str], n_layers: int) -> list[list[int]]:
    starts = []
    for point in split_points:
        prefix, _, index = point.rpartition(".")
        if prefix != "layers" or not index.isdigit() or not 0 < int(index) < n_layers:
            raise ConfigError(
                f"parallelism.pipeline_parallel_split_points: {point!r} names no layer where a "
                f"stage can start; use layers.1 .. layers.{n_layers - 1}"
            )
        starts.append(int(index))
    if starts != sorted(set(starts)):
        raise ConfigError(
            "parallelism.pipeline_parallel_split_points: must be increasing and distinct, got "
            f"{split_points}"
        )
    bounds = [0] + starts + [n_layers]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def _even_split(n_layers: int, num_stages: int, first_less: int, last_less: int) -> list[list[int]]:
    slots = ["embedding"] * first_less + list(range(n_layers)) + ["output"] * last_less
    if num_stages > len(slots):
        raise ConfigError(
            f"pipeline parallel: {num_stages} stages but only {n_layers} layers (+ embedding and "
            "output); use fewer stages (pipeline_parallel_degree or layers_per_stage)"
        )
    base, extra = divmod(len(slots), num_stages)
    stages, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        stages.append([x for x in slots[start : start + size] if isinstance(x, int)])
        start += size
    return stages


def _check_plan(plan: StagePlan, pp: int, multi: bool, v_shaped: bool, name: str) -> None:
    if plan.num_stages % pp != 0:
        raise ConfigError(
            f"pipeline parallel: {plan.num_stages} stages cannot be spread evenly over "
            f"pipeline_parallel_degree {pp}"
        )
    per_rank = plan.num_stages // pp
    if not multi and per_rank != 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: {name} runs one stage per rank, but the "
            f"split gives {per_rank}; use an interleaved schedule or fewer stages"
        )
    if multi and per_rank < 2:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: {name} needs at least 2 stages per rank, "
            f"the split gives {per_rank}"
        )
    if v_shaped and per_rank != 2:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: {name} needs exactly 2 stages per rank"
        )
    for s, layers in enumerate(plan.layers):
        if not layers and 0 < s < plan.num_stages - 1:
            raise ConfigError(
                f"pipeline parallel: stage {s} would hold no layer; use fewer stages than layers"
            )


def microbatches(parallelism: ParallelismConfig, local_batch_size: int, num_stages: int) -> int:
    """Pipeline micro-batches per local batch (``training.local_batch_size`` over
    ``parallelism.pipeline_parallel_microbatch_size``)."""
    local = local_batch_size
    size = parallelism.pipeline_parallel_microbatch_size
    if local % size != 0:
        raise ConfigError(
            f"training.local_batch_size ({local}) must be divisible by "
            f"parallelism.pipeline_parallel_microbatch_size ({size})"
        )
    n = local // size
    if n < num_stages:
        logger.warning(
            f"pipeline parallel: {n} micro-batches for {num_stages} stages leaves the pipeline "
            "mostly idle; raise training.local_batch_size"
        )
    return n


def build_stage_module(
    model: nn.Module, layer_ids: list[int], first: bool, last: bool
) -> nn.Module:
    """A copy of the (meta) model keeping only one stage's layers, FQNs unchanged."""
    stage = copy.deepcopy(model)
    for layer_id in list(stage.layers.keys()):
        if int(layer_id) not in layer_ids:
            del stage.layers[layer_id]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


@dataclass
class BuiltPipeline:
    """This rank's share of the pipeline: its stages (one per model part) and the schedule."""

    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    stages: list[PipelineStage]
    model_parts: list[nn.Module]
    has_first_stage: bool
    has_last_stage: bool


def pipeline_llm(
    model: nn.Module,
    parallel_dims: ParallelDims,
    parallelism: ParallelismConfig,
    local_batch_size: int,
    device: torch.device,
    parallelize: Callable[[nn.Module], nn.Module],
    loss_fn: Callable,
) -> BuiltPipeline:
    """Split ``model`` (on meta) into this rank's stages, ``parallelize`` each (the train
    spec's parallelize_fn with the run's settings), and build the schedule."""
    pp_mesh = parallel_dims.world_mesh["pp"]
    pp_rank, pp_degree = pp_mesh.get_local_rank(), pp_mesh.size()
    plan = plan_stages(parallelism, len(model.layers), pp_degree)
    stage_ids = plan.stages_of_rank(pp_rank, pp_degree)
    stages, parts = [], []
    for stage_id in stage_ids:
        first, last = stage_id == 0, stage_id == plan.num_stages - 1
        module = build_stage_module(model, plan.layers[stage_id], first, last)
        module = parallelize(module)
        parts.append(module)
        stages.append(
            PipelineStage(module, stage_id, plan.num_stages, device, group=pp_mesh.get_group())
        )
        logger.info(
            f"pipeline stage {stage_id}: layers {plan.layers[stage_id]}"
            f"{' + embedding' if first else ''}{' + output' if last else ''}"
        )
    schedule = build_schedule(stages, parallelism, local_batch_size, loss_fn)
    has_first = any(s == 0 for s in stage_ids)
    has_last = any(s == plan.num_stages - 1 for s in stage_ids)
    return BuiltPipeline(schedule, stages, parts, has_first, has_last)


def build_schedule(
    stages: list[PipelineStage],
    parallelism: ParallelismConfig,
    local_batch_size: int,
    loss_fn: Callable,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The configured schedule over this rank's ``stages``."""
    p = parallelism
    cls = schedule_class(p.pipeline_parallel_schedule, p.pipeline_parallel_schedule_csv)
    num_stages = stages[0].num_stages
    n_micro = microbatches(parallelism, local_batch_size, num_stages)
    # scale_grads=False: each micro-batch's loss is already its share of the global-batch
    # mean (the recipe's GlobalTokenMeanLoss), so the gradients are summed as they are.
    if issubclass(cls, PipelineScheduleSingle):
        schedule = cls(stages[0], n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)
    if p.pipeline_parallel_schedule_csv:
        schedule._load_csv(p.pipeline_parallel_schedule_csv)
    logger.info(f"pipeline schedule {cls.__name__}: {num_stages} stages, {n_micro} micro-batches")
    return schedule


def forward_only_twin(
    pipeline: BuiltPipeline,
    parallelism: ParallelismConfig,
    local_batch_size: int,
    output_fn: Callable,
) -> BuiltPipeline:
    """New stages over the same modules with a schedule of their own, run forward only
    (``schedule.eval``, ``output_fn(last stage output, target)`` per micro-batch in the
    losses list): a second pass over the model that leaves the training schedule's buffers
    and shape inference alone (LoRA's reference, the policy with its adapters off)."""
    stages = [
        PipelineStage(s.submod, s.stage_index, s.num_stages, s.device, group=s.group)
        for s in pipeline.stages
    ]
    schedule = build_schedule(stages, parallelism, local_batch_size, output_fn)
    return replace(pipeline, schedule=schedule, stages=stages)


def is_v_shaped(parallelism: ParallelismConfig) -> bool:
    """Whether the configured schedule places stages in a V (the last stage on pp rank 0):
    torch runs its backward actions even when asked to run forward only."""
    p = parallelism
    cls = schedule_class(p.pipeline_parallel_schedule, p.pipeline_parallel_schedule_csv)
    return issubclass(cls, _V_SHAPED)


def loss_owner_rank(parallelism: ParallelismConfig, parallel_dims: ParallelDims) -> int:
    """Global rank that owns the loss: the first rank of the pp coordinate holding the last
    stage. V-shaped schedules put the last stage on pp rank 0."""
    if not parallel_dims.pp_enabled:
        return 0
    last_pp_rank = 0 if is_v_shaped(parallelism) else parallel_dims.pp - 1
    return parallel_dims.first_rank_at("pp", last_pp_rank)
