"""``--memory_estimation.mode plan``: the layouts of a model on N GPUs that fit, ranked by
the planner's throughput model, the best traceable ones traced."""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections.abc import Iterator

from torchtitan.components.adapters.lora import LORA
from torchtitan.components.quantization import FLOAT8_LINEAR
from torchtitan.config import ConfigError, JobConfig, MemoryEstimationConfig, TrainingConfig
from torchtitan.config.checks import check_job_config
from torchtitan.distributed import ParallelDims
from torchtitan.estimate import layout_search, report
from torchtitan.estimate.build import TrainingBuild
from torchtitan.estimate.closed_form.from_config import closed_form_inputs
from torchtitan.estimate.closed_form.inputs import Run
from torchtitan.estimate.coverage import activation_checkpoint_gap, coverage_gap, resolve_world_size
from torchtitan.estimate.step_time import GPU_KINDS
from torchtitan.estimate.trace import trace_training_memory
from torchtitan.protocols.geometry import Geometry


def progress(message: str) -> None:
    """A progress line of the plan (stderr, flushed, like the log lines of a trace; the plan
    itself goes to stdout)."""
    print(f"planning: {message}", file=sys.stderr, flush=True)


def run_plan(job_config: JobConfig) -> int:
    me, training = job_config.memory_estimation, job_config.training
    build = TrainingBuild(job_config, resolve_world_size(me), me.target_device)
    request = plan_request(build, me, training)
    entries, enumerated = analytic_pass(request)
    print(
        f"plan: {job_config.model.name} {job_config.model.flavor}, seq_len {training.seq_len}, "
        f"global batch {request.global_batch} sequences, {request.world_size} GPUs of "
        f"{me.device_memory_gib:g} GiB ({me.gpus_per_node} per node)",
        flush=True,
    )
    if not entries:
        need, layout = layout_search.smallest_need(request)
        print(
            f"no layout fits in {me.device_memory_gib:g} GiB per GPU: the least any layout "
            f"needs is {report.gib(need)} GiB ({layout.describe()}, local batch 1); "
            "use more GPUs, a shorter training.seq_len or a smaller model",
            file=sys.stderr,
        )
        return 1
    for line in plan_lines(build, request, entries, enumerated, me.plan_traced_layouts):
        print(line, flush=True)
    if me.time:
        best = entries[0]
        print(
            f"\n  predicted step of #1 ({best.layout.describe()}, local batch "
            f"{best.local_batch} x {best.grad_accum}): {best.time.total:.3f} s, MFU "
            f"{best.time.mfu:.1%}"
        )
        print("\n".join(best.time.lines()))
    return 0


def plan_request(
    build: TrainingBuild, me: MemoryEstimationConfig, training: TrainingConfig
) -> layout_search.PlanRequest:
    """What to plan: the model's geometry, the batch, the GPUs."""
    _check_plannable(me, build.config.model.converters)
    global_batch = (
        training.global_batch_size
        if training.global_batch_size > 0
        else training.local_batch_size * build.world_size
    )
    overhead = (
        report.CUBLAS_WORKSPACE_BYTES
        + report.CUDA_CONTEXT_BYTES
        + (me.nccl_allowance_gib * 2**30 if build.world_size > 1 else 0)
    )
    return layout_search.PlanRequest(
        geometry=_planned_geometry(build),
        seq_len=training.seq_len,
        global_batch=global_batch,
        world_size=build.world_size,
        device_memory_gib=me.device_memory_gib,
        gpus_per_node=me.gpus_per_node,
        param_bytes=4 if training.mixed_precision_param == "float32" else 2,
        overhead_bytes=overhead,
        reserved_margin=me.reserved_margin,
        reduce_bytes=4 if training.mixed_precision_reduce == "float32" else 2,
        compile=build.config.compile.enable,
        gpu=GPU_KINDS[me.gpu],
        network_bytes_per_s=me.network_gbps_per_gpu * 1e9 / 8,
        run_settings=_run_settings(build),
    )


def _run_settings(build: TrainingBuild) -> Run:
    """What the configured run sets that no layout changes (the loss chunk, the optimizer's
    kernels and state dtype, CP's rotation and load balancing), as the closed form reads it,
    and what the planner's layouts run: AC none or full (full keeps attention outputs only
    with ``save_attention_output = "always"``), 1F1B over one-sequence micro-batches."""
    config = build.config
    p = config.parallelism
    one_rank = ParallelDims(
        1, 1, 1, 1, 1, 1, 1,
        cp_rotate_method=p.context_parallel_rotate_method,
        cp_load_balancer=p.context_parallel_load_balancer,
    )  # fmt: skip
    _, _, run = closed_form_inputs(
        build.model_args(),
        one_rank,
        1,
        build.target,
        training=config.training,
        optimizer=config.optimizer,
        parallelism=p,
        activation_checkpoint=dataclasses.replace(config.activation_checkpoint, mode="full"),
        model=config.model,
        lora=config.lora,
    )
    return dataclasses.replace(run, pp_microbatch=1, pp_all_in_flight=False)


def _check_plannable(me: MemoryEstimationConfig, converters: list[str]) -> None:
    """The planner needs the memory per GPU, and models neither LoRA nor float8 yet."""
    if me.device_memory_gib is None:
        raise ConfigError(
            "memory_estimation.device_memory_gib: mode plan needs the memory per GPU in GiB, "
            "e.g. --memory_estimation.device_memory_gib 80"
        )
    if LORA in converters:
        raise ConfigError(
            "model.converters: the planner does not model LoRA yet; use --memory_estimation.mode "
            "analytic (one layout, instant) or estimate"
        )
    if any(name in FLOAT8_LINEAR for name in converters):
        raise ConfigError(
            "model.converters: the planner does not model float8 linears yet; use "
            "--memory_estimation.mode estimate (traced)"
        )


def _planned_geometry(build: TrainingBuild) -> Geometry:
    """The geometry of an attention decoder, dense or MoE, the planner's models."""
    model = build.config.model
    geometry = build.model_args().geometry()
    if geometry is None or geometry.mla is not None or geometry.delta_rule is not None:
        raise ConfigError(
            f"model.name: the planner covers attention decoders, dense or MoE (no latent "
            f"attention, no Gated DeltaNet layers); {model.name!r} {model.flavor!r} "
            "is not one; use mode analytic or estimate"
        )
    return geometry


def analytic_pass(
    request: layout_search.PlanRequest,
) -> tuple[list[layout_search.PlanEntry], int]:
    """(the layouts that fit, ranked; how many were enumerated), with progress lines."""
    try:
        layouts = layout_search.candidate_layouts(request)
        progress(
            f"{len(layouts)} layouts of {request.world_size} GPUs; analytic pass (peak memory "
            "and modelled throughput of each) ..."
        )
        start = time.perf_counter()
        entries = layout_search.fitting_entries(request, layouts)
    except layout_search.PlanError as e:
        raise ConfigError(str(e)) from None
    progress(
        f"{len(entries)} of {len(layouts)} layouts fit (analytic pass: "
        f"{time.perf_counter() - start:.1f} s)"
    )
    return entries, len(layouts)


PLAN_ROWS = 10
OTHER_ROWS = 5


def plan_lines(
    build: TrainingBuild,
    request: layout_search.PlanRequest,
    entries: list[layout_search.PlanEntry],
    enumerated: int,
    traced_layouts: int,
) -> Iterator[str]:
    """The best layouts the trainer runs and the estimator traces (the first
    ``traced_layouts`` traced, each line as its trace ends), then the best of the others
    (analytic figures only, with the reason)."""
    gaps = [layout_gap(layout_build(build, request, e)) for e in entries]
    supported = [(i, e) for i, (e, gap) in enumerate(zip(entries, gaps), start=1) if gap is None]
    others = [
        (i, e, gap) for i, (e, gap) in enumerate(zip(entries, gaps), start=1) if gap is not None
    ]
    kernels = "compiled" if request.compile else "eager"
    yield (
        f"  {len(entries)} of {enumerated} layouts fit "
        "(need = analytic peak x (1 + reserved_margin) + context, workspaces, NCCL), "
        f"ranked by the step-time model on {request.gpu.name} ({kernels}; "
        "benchmarks/step_time_calibration.md; --time: the breakdown of #1)"
    )
    yield ""
    yield "  layouts the trainer runs and the estimator traces:"
    yield _plan_header()
    yield from [_plan_row(i, e) for i, e in supported[:PLAN_ROWS]] or ["    (none)"]
    yield from _traced_lines(build, request, supported[:traced_layouts])
    if others:
        yield from ["", "  better-ranked or other layouts, analytic only:", _plan_header()]
        yield from [_plan_row(i, e) + f"  {gap}" for i, e, gap in others[:OTHER_ROWS]]


def _plan_header() -> str:
    return (
        f"  {'#':>4}  {'layout':<50}{'batch x accum':>14}{'peak GiB':>10}{'need GiB':>10}"
        f"{'tok/s/GPU':>11}{'MFU':>7}"
    )


def _plan_row(rank: int, entry: layout_search.PlanEntry) -> str:
    batch = f"{entry.local_batch} x {entry.grad_accum}"
    return (
        f"  {rank:>4}  {entry.layout.describe():<50}{batch:>14}{report.gib(entry.peak_bytes):>10}"
        f"{report.gib(entry.need_bytes):>10}{entry.tokens_per_second_per_gpu:>11,.0f}"
        f"{entry.time.mfu:>7.1%}"
    )


def _traced_lines(
    build: TrainingBuild,
    request: layout_search.PlanRequest,
    chosen: list[tuple[int, layout_search.PlanEntry]],
) -> Iterator[str]:
    to_trace = sum(entry.layout.pp == 1 for _, entry in chosen)
    traced = 0
    for rank, entry in chosen:
        if entry.layout.pp > 1:
            yield (
                f"    traced #{rank}: not traced here: a pipeline layout is traced per "
                "pipeline rank through every micro-batch (long at this size); "
                "run mode estimate for it"
            )
            continue
        traced += 1
        yield _traced_line(build, request, rank, entry, f"{traced} of {to_trace}")


def _traced_line(
    build: TrainingBuild,
    request: layout_search.PlanRequest,
    rank: int,
    entry: layout_search.PlanEntry,
    count: str,
) -> str:
    progress(
        f"tracing layout {count} (#{rank} {entry.layout.describe()}, local batch "
        f"{entry.local_batch}) on fake tensors ..."
    )
    outcome = trace_training_memory(layout_build(build, request, entry))
    progress(f"traced layout {count} in {outcome.seconds:.0f} s")
    peak = outcome.result.peak_bytes
    return (
        f"    traced #{rank}: {report.gib(peak)} GiB allocated peak (analytic "
        f"{(entry.peak_bytes - peak) / peak:+.2%}; traced in {outcome.seconds:.0f} s)"
    )


def layout_build(
    build: TrainingBuild, request: layout_search.PlanRequest, entry: layout_search.PlanEntry
) -> TrainingBuild:
    """The configured run on the entry's layout: its degrees, AC and local batch, the
    request's global batch, eager."""
    config = copy.deepcopy(build.config)
    lay, p = entry.layout, config.parallelism
    p.data_parallel_replicate_degree, p.data_parallel_shard_degree = lay.dp_replicate, lay.dp_shard
    p.context_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree = (
        lay.cp,
        lay.tp,
        lay.pp,
    )
    p.expert_parallel_degree, p.expert_tensor_parallel_degree = lay.ep, lay.etp
    config.activation_checkpoint.mode = lay.ac
    config.training.local_batch_size = entry.local_batch
    config.training.global_batch_size = request.global_batch
    config.compile.enable = False
    return TrainingBuild(config, request.world_size, build.target)


def layout_gap(build: TrainingBuild) -> str | None:
    """Why a layout cannot be traced ('not in trainer: ...', 'estimator: ... not covered
    yet'), or None."""
    config = build.config
    try:
        check_job_config(config)
        parallel_dims = build.parallel_dims()
    except ConfigError as e:
        return f"not in trainer: {_first_clause(str(e))}"
    gap = activation_checkpoint_gap(config.activation_checkpoint.mode) or coverage_gap(
        config.model.converters, config.parallelism, config.training, parallel_dims
    )
    return None if gap is None else f"estimator: {gap.split(':')[1].strip()} not covered yet"


def _first_clause(message: str, limit: int = 70) -> str:
    clause = message.split(";")[0].split(" (")[0]
    return clause if len(clause) <= limit else clause[: limit - 3] + "..."
