"""``python scripts/estimate/estimation.py --job.config_file F.toml [overrides]``: estimate
one layout by tracing it or in closed form (this module), plan layouts (``plan_mode``) or
measure a real run beside the estimate (``measure_mode``)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from torchtitan.components.adapters.lora import LORA
from torchtitan.config import (
    ConfigError,
    ConfigManager,
    JobConfig,
    MemoryEstimationConfig,
    ModelConfig,
)
from torchtitan.config.entry import config_errors_exit
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.estimate import plot, report
from torchtitan.estimate.build import TrainingBuild
from torchtitan.estimate.closed_form.from_config import closed_form_inputs
from torchtitan.estimate.closed_form.inputs import Layout, Run
from torchtitan.estimate.closed_form.peak import (
    AnalyticEstimate,
    estimate_peak,
    not_covered,
    training_peak,
)
from torchtitan.estimate.closed_form.phases import BASE_LOAD
from torchtitan.estimate.coverage import check_covered, eager, resolve_world_size
from torchtitan.estimate.measure_mode import measure_single_process, run_measure
from torchtitan.estimate.plan_mode import run_plan
from torchtitan.estimate.steps import ITERATIONS, microbatches_per_step
from torchtitan.estimate.time_mode import check_gpu_kind, time_lines
from torchtitan.estimate.trace import TraceOutcome, trace_training_memory
from torchtitan.protocols.geometry import Geometry
from torchtitan.recipe import Recipe, grad_accumulation_steps, resolve_for_device
from torchtitan.tools.logging import init_logger

# The trainer refuses memory_estimation.enable; this script always estimates, so the flag
# (which upstream's run script passes) is accepted here as a no-op.
_ENABLE_FLAGS = ("--memory_estimation.enable", "--memory_estimation.enabled")
TIME_FLAG = "--time"  # short for --memory_estimation.time


def closed_form_of(setup: Recipe, target: str) -> AnalyticEstimate | str:
    """The closed form of the traced recipe (built from ``setup.job_config``), or why there
    is none."""
    config = setup.job_config
    geometry, layout, run = closed_form_inputs(
        setup.model_args,
        setup.parallel_dims,
        setup.grad_accum_steps,
        target,
        training=config.training,
        optimizer=config.optimizer,
        parallelism=config.parallelism,
        activation_checkpoint=config.activation_checkpoint,
        model=config.model,
        lora=config.lora,
    )
    if geometry is None:
        return "analytic estimate: not available (the model args are not a decoder it knows)"
    closed_form = estimate_peak(geometry, layout, run)
    if closed_form is None:
        return f"analytic estimate: not available for {not_covered(geometry, layout, run)}"
    return closed_form


def analytic_lines(closed_form: AnalyticEstimate | str, traced: int) -> list[str]:
    """The closed form beside the trace; under QLoRA the training phases beside the trace,
    and the start (the base made NF4 block by block), which only the closed form models."""
    if isinstance(closed_form, str):
        return [closed_form]
    load = closed_form.phases.get(BASE_LOAD)
    if load is None:
        return report.analytic_lines(traced, closed_form)
    peak, phase = training_peak(closed_form)
    training = dataclasses.replace(closed_form, peak_bytes=peak, phase=phase)
    return report.analytic_lines(traced, training) + [
        f"QLoRA start (closed form; not traced): making the base NF4 block by block needs "
        f"{report.size(load)} per rank"
    ]


def start_peak(closed_form: AnalyticEstimate | str) -> int:
    """QLoRA's start peak (0 without): the allocations before the first step."""
    if isinstance(closed_form, str):
        return 0
    return int(closed_form.phases.get(BASE_LOAD, 0))


def degrees(parallel_dims: ParallelDims) -> str:
    names = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    parts = [f"{n}={getattr(parallel_dims, n)}" for n in names if getattr(parallel_dims, n) > 1]
    return " x ".join(parts) or "single device"


def header_lines(setup: Recipe, world_size: int, target: str) -> list[str]:
    """What was traced: the model, layout, batch, dtypes, optimizer and AC of the recipe."""
    model, t, o = setup.job_config.model, setup.job_config.training, setup.job_config.optimizer
    vocab_source = "tokenizer" if model.tokenizer_path else "flavor; no model.tokenizer_path"
    ac = setup.job_config.activation_checkpoint
    ac_text = ac.mode if ac.mode != "selective" else f"selective ({ac.selective_ac_option})"
    lines = [
        f"memory estimate: {model.name} {model.flavor}, {world_size} ranks "
        f"({degrees(setup.parallel_dims)})",
        f"  seq_len {t.seq_len} x local batch {t.local_batch_size}, {_microbatch_text(setup)}; "
        f"params {t.mixed_precision_param}, reduce {t.mixed_precision_reduce}; "
        f"{o.name} ({o.implementation}); activation checkpointing {ac_text}",
        f"  vocabulary {setup.model_args.vocab_size:,} (from the {vocab_source}); "
        f"target device {target}"
        + (
            ": CUDA-kernel emulation (rms_norm) and 512-byte block rounding"
            if target == "cuda"
            else ""
        ),
    ]
    converters = [name for name in model.converters if name != LORA]
    if converters:
        lines.append(
            f"  model converters {', '.join(converters)}: traced eagerly as configured "
            "(compile's fused casts may need less)"
        )
    if getattr(setup.model_args, "moe", None) is not None:
        lines.append(
            "  MoE routing assumed perfectly balanced (every expert gets tokens x top_k / "
            "experts); real imbalance adds to the expert activations"
        )
    return lines


def _microbatch_text(setup: Recipe) -> str:
    accum, traced = setup.grad_accum_steps, microbatches_per_step(setup)
    if accum == traced:
        return f"{accum} micro-batch{'es' if accum > 1 else ''} per step"
    return f"{accum} micro-batches per step (traced {traced}; the others repeat the last)"


def run_estimate(job_config: JobConfig) -> int:
    me = job_config.memory_estimation
    world_size = resolve_world_size(me)
    job_config = dataclasses.replace(job_config, compile=eager(job_config.compile))
    build = TrainingBuild(job_config, world_size, me.target_device)
    check_covered(build)
    if me.disable_fake_mode:
        return _estimate_on_real_tensors(build)
    outcome = trace_training_memory(build)
    print("\n".join(estimate_lines(outcome, world_size, me)))
    if me.plot is not None:
        title = plot_title(job_config.model, outcome, world_size, me.target_device)
        plot.save_breakdown_plot(outcome.result, title, me.plot)
        print(f"plot: {me.plot}")
    return 0


def plot_title(model: ModelConfig, outcome: TraceOutcome, world_size: int, target: str) -> str:
    layout = degrees(outcome.setup.parallel_dims)
    return (
        f"{model.name} {model.flavor}, {world_size} ranks ({layout}): "
        f"traced memory per rank by phase, target {target}"
    )


def estimate_lines(outcome: TraceOutcome, world_size: int, me: MemoryEstimationConfig) -> list[str]:
    result = outcome.result
    lines = header_lines(outcome.setup, world_size, me.target_device)
    traced = (
        "rank 0"
        if outcome.stage_peaks is None
        else f"the first rank of each of {len(outcome.stage_peaks)} pipeline ranks"
    )
    lines += [
        f"  traced {traced} of {world_size} over {ITERATIONS} steps in {outcome.seconds:.1f} s",
        "",
        f"traced allocated peak per rank: {report.size(result.peak_bytes)} "
        f"({result.peak_bytes:,} B)",
    ]
    if outcome.stage_peaks is not None:
        per_stage = ", ".join(
            f"pp {i} {report.size(p, result.peak_bytes)}" for i, p in enumerate(outcome.stage_peaks)
        )
        lines.append(
            f"  peak per pipeline rank: {per_stage} (largest: pp {outcome.pp_rank}; "
            "details below are its)"
        )
    lines.append(report.where_line(result))
    if me.target_device == "cuda":
        lines.append(f"  includes 512-byte block rounding: {result.rounding_bytes / 2**20:.2f} MiB")
    lines += (
        report.breakdown_lines(result) + report.phase_lines(result) + report.module_lines(result)
    )
    closed_form = closed_form_of(outcome.setup, me.target_device)
    lines += [""] + analytic_lines(closed_form, result.peak_bytes) + [""]
    if me.target_device == "cpu":
        return lines + [
            "target cpu: no device additions (the figure is what the CPU allocator is asked for)"
        ]
    peak = max(result.peak_bytes, start_peak(closed_form))
    additions = report.device_additions(peak, world_size, me.reserved_margin, me.nccl_allowance_gib)
    return lines + report.additions_lines(peak, additions, me.device_memory_gib)


@dataclass
class AnalyticFit:
    peak: AnalyticEstimate
    parallel_dims: ParallelDims
    verdict: str


def analytic_fit(job_config: JobConfig) -> AnalyticFit:
    """The closed-form peak of the configured layout (checked as the trainer checks it) and
    the verdict for ``memory_estimation.device_memory_gib``: instant even for 405B or 671B,
    whose traces would take far longer. Mode analytic's computation."""
    me = job_config.memory_estimation
    if me.device_memory_gib is None:
        raise ConfigError(
            "memory_estimation.device_memory_gib: mode analytic needs the memory per GPU "
            "in GiB, e.g. --memory_estimation.device_memory_gib 80"
        )
    build = TrainingBuild(job_config, resolve_world_size(me), me.target_device)
    parallel_dims = check_covered(build)
    geometry, layout, run = closed_form_inputs(
        build.model_args(),
        parallel_dims,
        grad_accumulation_steps(job_config.training, parallel_dims),
        me.target_device,
        training=job_config.training,
        optimizer=job_config.optimizer,
        parallelism=job_config.parallelism,
        activation_checkpoint=job_config.activation_checkpoint,
        model=job_config.model,
        lora=job_config.lora,
    )
    closed_form = _covered_closed_form(geometry, layout, run, job_config.model.name)
    additions = report.device_additions(
        closed_form.peak_bytes, build.world_size, me.reserved_margin, me.nccl_allowance_gib
    )
    return AnalyticFit(
        closed_form,
        parallel_dims,
        report.fit_verdict(closed_form.peak_bytes, additions, me.device_memory_gib),
    )


def _covered_closed_form(
    geometry: Geometry | None, layout: Layout, run: Run, model_name: str
) -> AnalyticEstimate:
    """The closed form's peak, or a ConfigError saying why it does not cover the run."""
    if geometry is None:
        raise ConfigError(
            f"model.name={model_name!r}: the closed form does not cover this model; "
            "use mode estimate"
        )
    closed_form = estimate_peak(geometry, layout, run)
    if closed_form is None:
        raise ConfigError(
            f"model.name={model_name!r}: the closed form does not cover "
            f"{not_covered(geometry, layout, run)}; use mode estimate"
        )
    return closed_form


def run_analytic(job_config: JobConfig) -> int:
    fit = analytic_fit(job_config)
    print(
        f"analytic memory estimate: {job_config.model.name} {job_config.model.flavor}, "
        f"{fit.parallel_dims.world_size} ranks ({degrees(fit.parallel_dims)}), "
        f"activation checkpointing {job_config.activation_checkpoint.mode}"
    )
    print(
        f"analytic allocated peak per rank: {report.size(fit.peak.peak_bytes)} "
        f"(in the {fit.peak.phase}; a CUDA rank adds its context, cuBLAS workspaces, "
        "allocator reserve and NCCL buffers)"
    )
    print(fit.verdict)
    return 0


def _estimate_on_real_tensors(build: TrainingBuild) -> int:
    measured = measure_single_process(build)
    print(
        f"measured on real tensors (rank 0 of {build.world_size} emulated in one process, "
        f"{measured.method}): {report.size(measured.peak_bytes)} ({measured.peak_bytes:,} B)"
    )
    if measured.tracker is not None:
        print(
            "\n".join(
                report.breakdown_lines(measured.tracker) + report.phase_lines(measured.tracker)
            )
        )
    return 0


@config_errors_exit
def main(argv: list[str] | None = None) -> int:
    init_logger()
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a not in _ENABLE_FLAGS]
    if TIME_FLAG in args:
        args = [a for a in args if a != TIME_FLAG] + ["--memory_estimation.time"]
    job_config = ConfigManager().parse_args(args)
    for name, section in (("dpo", job_config.dpo), ("grpo", job_config.grpo)):
        if section.enable:
            raise ConfigError(
                f"{name}.enable: the estimator does not model the reference (a second copy "
                "of the weights without LoRA) and its forward, nor rollouts, yet; estimate the "
                f"run without {name}.enable and add one model's parameters per rank"
            )
    _check_time_request(job_config)
    if job_config.memory_estimation.plot is not None:
        plot.require_matplotlib()  # before tracing
    # decided for the target as the trainer decides for its device: a CPU target is this
    # machine, a GPU target never depends on the CPU computing the estimate
    for decision in resolve_for_device(job_config, job_config.memory_estimation.target_device):
        print(f"note: {decision}")
    modes = {
        "estimate": run_estimate,
        "analytic": run_analytic,
        "plan": run_plan,
        "measure": run_measure,
    }
    status = modes[job_config.memory_estimation.mode](job_config)
    me = job_config.memory_estimation
    if status == 0 and me.time and me.mode in ("estimate", "analytic"):
        build = TrainingBuild(job_config, resolve_world_size(me), me.target_device)
        print("\n".join([""] + time_lines(build, build.parallel_dims())))
    return status


def _check_time_request(job_config: JobConfig) -> None:
    """The step-time model predicts GPU runs of mode estimate, analytic or plan (before any
    of them starts: a trace can take minutes)."""
    me = job_config.memory_estimation
    if not me.time:
        return
    check_gpu_kind(me, job_config.model.converters)
    if me.mode == "measure":
        raise ConfigError(
            "memory_estimation.time: mode measure runs on this machine, which the step-time "
            "model does not predict; use mode estimate, analytic or plan with --time"
        )
    if me.target_device != "cuda":
        raise ConfigError(
            "memory_estimation.time: the step-time model predicts GPU runs; drop "
            "--memory_estimation.target_device cpu (or --time)"
        )
