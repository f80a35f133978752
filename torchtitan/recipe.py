"""The training recipe, shared by the trainer (``torchtitan/train.py``) and the memory
estimator (``torchtitan/estimate/``): a change to how training builds or steps is made here,
once, and both see it.

* the derived quantities: gradient-accumulation steps (micro-batches per step) and the MoE
  auxiliary-loss scale;
* the build sequence: model on meta -> converters -> parallelize (or split into pipeline
  stages) -> materialize and init -> optimizers -> LR schedulers;
* the train context every forward and backward runs in (loss parallel, autocast);
* one step in two calls: ``compute_gradients`` (zero_grad -> forward/loss/backward per
  micro-batch, with context-parallel sharding of the batch -> clip), which returns a
  ``StepResult``, then ``apply_step`` (optimizer and LR step); ``train_step`` runs both.

The trainer keeps its loop, checkpointing, metrics, validation and signals, and decides
between the two calls whether the step applies (its non-finite and stop checks). The
estimator observes the step through a ``StepObserver`` and replays pipeline schedules on fake
tensors through ``forward_backward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.components.adapters.lora import LORA
from torchtitan.components.adapters.lora_linear import adapters_off
from torchtitan.components.adapters.qlora import PendingBase, uses_nf4
from torchtitan.components.optimizers.builder import (
    OptimizersContainer,
    resolve_optimizer_for_device,
)
from torchtitan.components.optimizers.lr_schedule import LRSchedulersContainer
from torchtitan.components.policy_loss import GRPOSettings, PolicyLoss, count_completions
from torchtitan.components.preference_loss import (
    DPOSettings,
    PreferenceLoss,
    count_pairs,
    pair_logps,
    pair_slots,
    pipeline_target,
)
from torchtitan.components.training_loss import bind_output, build_loss_fn
from torchtitan.config import (
    ConfigError,
    JobConfig,
    ParallelismConfig,
    TrainingConfig,
    ValidationConfig,
)
from torchtitan.data.micro_batch import MicroBatch, model_inputs
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.context_parallel.collectives import SumOverRanks
from torchtitan.distributed.context_parallel.layout import cp_shard
from torchtitan.distributed.fault_tolerance import ReplicaGroups
from torchtitan.distributed.pipeline import BuiltPipeline, forward_only_twin
from torchtitan.distributed.process import clip_grad_norm_
from torchtitan.layers.init import clean_fqn
from torchtitan.layers.loss import GlobalTokenMeanLoss, token_logps, valid_tokens
from torchtitan.layers.moe import moe_layers
from torchtitan.protocols import ModelConvertersContainer, TrainSpec
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.tokenizer import BaseTokenizer
from torchtitan.tools.cpu_precision import resolve_cpu_precision
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.logging import logger

NextBatch = Callable[[], MicroBatch]
"""Returns the next micro-batch on the training device."""


class StepObserver(Protocol):
    """Watches a training step (the memory estimator's trackers); the trainer uses none."""

    def start_microbatch(self, module: nn.Module | None = None) -> None: ...

    def set_phase(self, phase: str) -> None: ...


class _Unobserved:
    def start_microbatch(self, module: nn.Module | None = None) -> None:
        pass

    def set_phase(self, phase: str) -> None:
        pass


UNOBSERVED: StepObserver = _Unobserved()


# ---------------------------------------------------------------------------- device choices
def resolve_for_device(job_config: JobConfig, device_type: str) -> list[str]:
    """Resolve in ``job_config``, once, every setting whose value depends on the machine that
    trains: the CPU's low precision (``training.cpu_low_precision``), the optimizer's fused
    kernels and Muon's ``ns_dtype = "auto"``. For ``device_type``: the trainer's own device,
    the memory estimator's target (a GPU run is never planned from the CPU that computes the
    plan). Returns one line per decision. A resolved config resolves to itself."""
    precision = resolve_cpu_precision(job_config.training, device_type)
    return ([precision] if precision else []) + resolve_optimizer_for_device(
        job_config.optimizer, device_type
    )


# ---------------------------------------------------------------------------- derived quantities
def grad_accumulation_steps(training: TrainingConfig, parallel_dims: ParallelDims) -> int:
    """Micro-batches per optimizer step: the global batch over local batch x dp degree (under
    fault tolerance the global batch spans every replica group)."""
    dp = parallel_dims.dp_degree * parallel_dims.replica_groups
    per_pass = training.local_batch_size * dp
    global_batch = training.global_batch_size if training.global_batch_size > 0 else per_pass
    if global_batch % per_pass != 0:
        raise ConfigError(
            f"training.global_batch_size ({global_batch}) must be a multiple of "
            f"local_batch_size x data-parallel degree ({training.local_batch_size} x {dp} "
            f"= {per_pass})"
        )
    return global_batch // per_pass


def set_moe_aux_loss_scale(model: nn.Module, grad_accum_steps: int) -> None:
    """The MoE auxiliary loss is averaged over the micro-batches like the main loss."""
    for moe in moe_layers([model]).values():
        moe.aux_loss_scale = 1 / grad_accum_steps


def max_seq_len(training: TrainingConfig, validation: ValidationConfig) -> int:
    """The longest sequence the model sees: training's, or validation's if that is longer."""
    if validation.enable:
        return max(training.seq_len, validation.seq_len)
    return training.seq_len


def model_args_from_config(
    spec: TrainSpec, job_config: JobConfig, tokenizer: BaseTokenizer | None
) -> BaseModelArgs:
    """The flavor's args updated from the config (and the tokenizer's vocabulary, if any)."""
    try:
        model_args = spec.flavor_args(job_config.model.flavor)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model_args.update_from_config(
        job_config.model,
        max_seq_len=max_seq_len(job_config.training, job_config.validation),
        tokenizer=tokenizer,
        moe_force_load_balance=job_config.debug.moe_force_load_balance,
    )
    return model_args


def parallelize_settings(job_config: JobConfig) -> dict[str, Any]:
    """The config slices a train spec's ``parallelize_fn`` takes as keyword arguments."""
    return {
        "training": job_config.training,
        "parallelism": job_config.parallelism,
        "activation_checkpoint": job_config.activation_checkpoint,
        "compile_config": job_config.compile,
    }


# ---------------------------------------------------------------------------- build
@dataclass
class MetaModel:
    """The parallelized model on meta: one part, or this rank's pipeline stages."""

    spec: TrainSpec
    model_args: BaseModelArgs
    model_parts: list[nn.Module]
    pipeline: BuiltPipeline | None
    converters: ModelConvertersContainer
    loss_fn: GlobalTokenMeanLoss
    grad_accum_steps: int
    nparams: int
    flops_per_token: int
    preference: PreferenceLoss | None = None  # DPO: the loss on preference pairs


@dataclass(frozen=True)
class Recipe:
    """Everything one training step needs, built in the recipe's order; not changed after."""

    job_config: JobConfig
    parallel_dims: ParallelDims
    device: torch.device
    spec: TrainSpec
    model_args: BaseModelArgs
    model_parts: list[nn.Module]
    pipeline: BuiltPipeline | None
    loss_fn: GlobalTokenMeanLoss
    grad_accum_steps: int
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    train_context: Callable[[], contextlib.AbstractContextManager]
    nparams: int
    flops_per_token: int
    pending_base: PendingBase | None = None  # QLoRA: base weights made NF4 after the load
    preference: PreferenceLoss | None = None  # DPO: the loss on preference pairs
    policy: PolicyLoss | None = None  # GRPO: the policy-gradient loss on rollouts
    reference_parts: list[nn.Module] | None = None
    """DPO's and GRPO's (with a KL term) frozen reference (the starting weights, laid out as
    the policy); None under LoRA, whose reference is the policy with its adapters off."""
    reference_pipeline: BuiltPipeline | None = None
    """DPO under pipeline parallel: the reference's stages (the frozen copy's, or under LoRA
    the policy's) with a forward-only schedule giving the last stage token log-probs."""

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self.parallel_dims.world_mesh["pp"] if self.parallel_dims.pp_enabled else None


def build_meta_model(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    spec: TrainSpec,
    model_args: BaseModelArgs,
    device: torch.device,
) -> MetaModel:
    """Model on meta, converters, then the spec's parallelize_fn, or under pipeline parallel
    its pipelining_fn (this rank's stages and the schedule, whose stages live on ``device``).
    The memory estimator runs this outside FakeTensorMode (torch >= 2.13 cannot swap fake
    parameters in ``Module._apply``) and ``materialize`` inside it."""
    model, converters = converted_meta_model(job_config, parallel_dims, spec, model_args)
    if job_config.model.print_after_conversion:
        logger.info(f"model after the converters:\n{model}")
    nparams, flops_per_token = model_args.get_nparams_and_flops(model, job_config.training.seq_len)
    accum = grad_accumulation_steps(job_config.training, parallel_dims)
    set_moe_aux_loss_scale(model, accum)
    loss_fn = build_loss_fn(
        job_config.training,
        job_config.compile,
        spec,
        model,
        device.type,
        parallel_dims.tp,
        logits_for=logits_reader(job_config),
    )
    preference = preference_loss(job_config)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    pipeline = None
    if parallel_dims.pp_enabled:
        schedule_loss = preference.pipeline_loss if preference is not None else loss_fn
        pipeline = pipelined(job_config, parallel_dims, spec, model, device, schedule_loss)
        parts = pipeline.model_parts
    else:
        parts = [spec.parallelize_fn(model, parallel_dims, **parallelize_settings(job_config))]
    keep_frozen(parts, frozen)
    bind_output(loss_fn, parts)
    return MetaModel(
        spec,
        model_args,
        parts,
        pipeline,
        converters,
        loss_fn,
        accum,
        nparams,
        flops_per_token,
        preference,
    )


def pipelined(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    spec: TrainSpec,
    model: nn.Module,
    device: torch.device,
    loss_fn: Callable,
) -> BuiltPipeline:
    """This rank's stages of ``model`` (on meta), each parallelized, and their schedule."""
    settings = parallelize_settings(job_config)
    return spec.pipelining_fn(
        model,
        parallel_dims,
        job_config.parallelism,
        job_config.training.local_batch_size,
        device,
        lambda stage: spec.parallelize_fn(stage, parallel_dims, **settings),
        loss_fn,
    )


def preference_loss(job_config: JobConfig) -> PreferenceLoss | None:
    """DPO's loss (None without DPO)."""
    dpo = job_config.dpo
    if not dpo.enable:
        return None
    return PreferenceLoss(DPOSettings(dpo.beta, dpo.loss_type, dpo.label_smoothing))


def converted_meta_model(
    job_config: JobConfig, parallel_dims: ParallelDims, spec: TrainSpec, model_args: BaseModelArgs
) -> tuple[nn.Module, ModelConvertersContainer]:
    """The model on meta with the configured converters applied, in the training dtype."""
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    converters = ModelConvertersContainer(job_config, parallel_dims)
    converters.convert(model)
    cast_parameters(model, TORCH_DTYPES[job_config.training.dtype])
    return model, converters


def logits_reader(job_config: JobConfig) -> str | None:
    """The loss that reads the whole logits (DPO's, GRPO's and its rollouts'), if any."""
    if job_config.dpo.enable:
        return "DPO"
    return "GRPO" if job_config.grpo.enable else None


def keep_frozen(parts: list[nn.Module], frozen: set[str]) -> None:
    """Freeze again the parameters (by FQN) that were frozen before parallelisation: some
    of torch's tensor-parallel styles (SequenceParallel) rebuild parameters trainable."""
    for part in parts:
        for name, param in part.named_parameters():
            if clean_fqn(name) in frozen:
                param.requires_grad_(False)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Store the floating-point parameters in ``dtype`` (training.dtype; bfloat16 = full bf16
    training: gradients and optimizer states follow the parameters). Buffers keep their dtype
    (RoPE tables stay float32); tied parameters stay tied."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in cast:
                cast[id(param)] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
            setattr(module, name, cast[id(param)])


def materialize(
    meta: MetaModel,
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    device: torch.device,
    *,
    seed: int | None,
    init_device: torch.device | None = None,
) -> Recipe:
    """Allocate the parts on ``init_device`` (default ``device``; the CPU under FSDP's CPU
    offload, buffers staying on ``device``), initialise them from ``seed`` (None: leave the
    values unset, as a fake-tensor trace does), then build optimizers and LR schedulers.
    Under QLoRA the adapted linears' base weights stay on meta (``Recipe.pending_base``)."""
    target = init_device or device
    pending = PendingBase(meta.model_parts, target, seed) if uses_nf4(job_config.lora) else None
    for part in meta.model_parts:
        if pending is not None:
            pending.materialize_except(part)
        else:
            part.to_empty(device=target)
        initialise(part, seed, device)
    optimizers = meta.spec.build_optimizers_fn(
        meta.model_parts, job_config.optimizer, parallel_dims
    )
    lr_schedulers = meta.spec.build_lr_schedulers_fn(
        optimizers, job_config.lr_scheduler, job_config.training.steps
    )
    optimizers.register_step_post_hook(
        lambda *args, **kwargs: meta.converters.post_optimizer_hook(meta.model_parts)
    )
    return Recipe(
        job_config=job_config,
        parallel_dims=parallel_dims,
        device=device,
        spec=meta.spec,
        model_args=meta.model_args,
        model_parts=meta.model_parts,
        pipeline=meta.pipeline,
        loss_fn=meta.loss_fn,
        grad_accum_steps=meta.grad_accum_steps,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        train_context=train_context_factory(
            job_config.training, job_config.parallelism, parallel_dims, device.type
        ),
        nparams=meta.nparams,
        flops_per_token=meta.flops_per_token,
        pending_base=pending,
        preference=meta.preference,
    )


def initialise(part: nn.Module, seed: int | None, buffer_device: torch.device) -> None:
    """Per-FQN seeded weights (None: left unset, as a fake-tensor trace does), train mode."""
    if seed is not None:
        with torch.no_grad():
            part.init_weights(seed=seed, buffer_device=buffer_device)
    part.train()


def build_recipe(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    spec: TrainSpec,
    model_args: BaseModelArgs,
    device: torch.device,
    *,
    seed: int | None,
    init_device: torch.device | None = None,
) -> Recipe:
    """The whole build sequence on real tensors; under DPO and GRPO (with a KL term) also the
    reference (see ``build_reference``)."""
    meta = build_meta_model(job_config, parallel_dims, spec, model_args, device)
    recipe = materialize(
        meta, job_config, parallel_dims, device, seed=seed, init_device=init_device
    )
    dpo, grpo = job_config.dpo, job_config.grpo
    if not (dpo.enable or grpo.enable):
        return recipe
    reference, reference_pipeline = None, None
    if dpo.enable or grpo.beta != 0.0:
        if recipe.pipeline is None:
            reference = build_reference(
                job_config, parallel_dims, spec, model_args, device, seed, init_device
            )
        else:  # DPO (GRPO refuses pipeline parallel)
            reference, reference_pipeline = build_reference_pipeline(recipe, seed, init_device)
    if dpo.enable:
        return replace(recipe, reference_parts=reference, reference_pipeline=reference_pipeline)
    settings = GRPOSettings(
        beta=grpo.beta,
        epsilon=grpo.epsilon,
        epsilon_high=grpo.epsilon_high,
        loss_type=grpo.loss_type,
        scale_rewards=grpo.scale_rewards,
        max_completion_length=grpo.max_completion_length,
        use_bias_correction_kl=grpo.use_bias_correction_kl,
    )
    policy = PolicyLoss(settings, grpo.temperature)
    return replace(recipe, policy=policy, reference_parts=reference)


def build_reference(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    spec: TrainSpec,
    model_args: BaseModelArgs,
    device: torch.device,
    seed: int | None,
    init_device: torch.device | None,
) -> list[nn.Module] | None:
    """The reference of DPO and GRPO: the model built and initialised as the policy is (the
    same seeded weights per FQN, the same layout), frozen; the trainer then loads the
    configured initial weights into it. None under LoRA (the policy with its adapters off
    is the reference)."""
    if LORA in job_config.model.converters:
        return None
    model, _ = converted_meta_model(job_config, parallel_dims, spec, model_args)
    reference = spec.parallelize_fn(model, parallel_dims, **parallelize_settings(job_config))
    freeze_initialised(reference, device, seed, init_device)
    return [reference]


def build_reference_pipeline(
    recipe: Recipe, seed: int | None, init_device: torch.device | None
) -> tuple[list[nn.Module] | None, BuiltPipeline]:
    """DPO's reference under pipeline parallel: its parts (as ``build_reference``) and
    stages with a schedule run forward only, whose last stage gets each micro-batch's token
    log-probs (``token_logps`` in the loss's place). Under LoRA the stages are the policy's,
    run with the adapters off; else the frozen copy's, split and laid out as the policy."""
    job_config, parallel_dims = recipe.job_config, recipe.parallel_dims
    if LORA in job_config.model.converters:
        twin = forward_only_twin(
            recipe.pipeline,
            job_config.parallelism,
            job_config.training.local_batch_size,
            token_logps,
        )
        return None, twin
    model, _ = converted_meta_model(job_config, parallel_dims, recipe.spec, recipe.model_args)
    pipeline = pipelined(job_config, parallel_dims, recipe.spec, model, recipe.device, token_logps)
    for part in pipeline.model_parts:
        freeze_initialised(part, recipe.device, seed, init_device)
    return pipeline.model_parts, pipeline


def freeze_initialised(
    part: nn.Module, device: torch.device, seed: int | None, init_device: torch.device | None
) -> None:
    """Allocate a reference part, initialise it as the policy's, and freeze it."""
    part.to_empty(device=init_device or device)
    initialise(part, seed, device)
    part.requires_grad_(False)


# ---------------------------------------------------------------------------- train context
def _autocast_dtype(training: TrainingConfig, parallel_dims: ParallelDims) -> torch.dtype | None:
    """FSDP casts parameters itself (MixedPrecisionPolicy); elsewhere autocast does."""
    dtype = TORCH_DTYPES[training.mixed_precision_param]
    return None if dtype == torch.float32 or parallel_dims.fsdp_enabled else dtype


def mixed_precision_summary(
    training: TrainingConfig, parallel_dims: ParallelDims, device_type: str
) -> str:
    if training.dtype == "bfloat16":
        return "full bf16 training: parameters, gradients and optimizer states in bfloat16"
    autocast_dtype = _autocast_dtype(training, parallel_dims)
    if autocast_dtype is not None:
        return f"mixed precision: autocast to {autocast_dtype} on {device_type}"
    if training.mixed_precision_param == "float32":
        return "mixed precision: off (float32)"
    return (
        f"mixed precision: FSDP parameters in {TORCH_DTYPES[training.mixed_precision_param]}, "
        f"reduce in {training.mixed_precision_reduce}"
    )


def train_context_factory(
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    parallel_dims: ParallelDims,
    device_type: str,
) -> Callable[[], contextlib.AbstractContextManager]:
    """The context every forward (and backward) runs in: loss parallel under TP (unless
    disabled), and autocast where FSDP does not cast parameters itself."""
    autocast_dtype = _autocast_dtype(training, parallel_dims)
    use_loss_parallel = parallel_dims.tp_enabled and not parallelism.disable_loss_parallel

    @contextlib.contextmanager
    def context():
        with contextlib.ExitStack() as stack:
            if use_loss_parallel:
                stack.enter_context(loss_parallel())
            if autocast_dtype is not None:
                stack.enter_context(torch.autocast(device_type, dtype=autocast_dtype))
            yield

    return context


# ---------------------------------------------------------------------------- the step
ForwardBackward = Callable[[Recipe, MicroBatch, StepObserver], "torch.Tensor | None"]


def forward_backward(recipe: Recipe, batch: MicroBatch, observer: StepObserver) -> torch.Tensor:
    """One micro-batch through the whole model; returns its detached loss (its share of
    the global-batch mean)."""
    inputs, labels, kwargs = model_inputs(
        batch, recipe.parallel_dims, recipe.job_config.training.reset_position_ids_per_document
    )
    observer.start_microbatch()
    observer.set_phase("forward")
    with recipe.train_context():
        pred = recipe.model_parts[0](inputs, **kwargs)
        observer.set_phase("loss")
        loss = recipe.loss_fn(pred, labels)
        del pred
        observer.set_phase("backward")
        loss.backward()
    return loss.detach()


def preference_forward_backward(
    recipe: Recipe, batch: MicroBatch, observer: StepObserver
) -> torch.Tensor:
    """DPO: the reference's log-probabilities of the micro-batch's completions (no
    gradient), then the policy's forward, the loss against them and the backward. Under
    context parallel every cp rank sums its share of each completion's log-probs, the sums
    are added over the cp ranks and each rank computes the pairs' loss whole."""
    inputs, labels, kwargs = model_inputs(
        batch, recipe.parallel_dims, recipe.job_config.training.reset_position_ids_per_document
    )
    pairs = pair_layout(recipe, kwargs["document_ids"])
    observer.start_microbatch()
    with recipe.train_context():
        observer.set_phase("reference forward")
        with torch.no_grad():
            logits = reference_logits(recipe, inputs, kwargs)
            reference = pair_logps(token_logps(logits, labels), labels, **pairs)
        observer.set_phase("forward")
        logits = recipe.model_parts[0](inputs, **kwargs)
        observer.set_phase("loss")
        loss = recipe.preference(logits, reference, labels, **pairs)
        del logits
        observer.set_phase("backward")
        loss.backward()
    # each cp rank's loss is the whole pairs' (the reported loss averages over dp x cp)
    return loss.detach() / recipe.parallel_dims.cp


def pair_layout(recipe: Recipe, document_ids: torch.Tensor) -> dict[str, Any]:
    """``pair_logps``'s document ids, slots and combine for this rank: under context
    parallel its share of the document ids, the whole sequence's slots, and the sum over
    the cp ranks."""
    parallel_dims = recipe.parallel_dims
    if not parallel_dims.cp_enabled:
        return {"document_ids": document_ids}
    cp_mesh = parallel_dims.world_mesh["cp"]
    group = cp_mesh.get_group()
    return {
        "document_ids": cp_shard(document_ids, 1, cp_mesh, parallel_dims.cp_load_balancer),
        "slots": pair_slots(document_ids.shape[1]),
        "combine": lambda sums: SumOverRanks.apply(sums, group),
    }


def reference_logits(
    recipe: Recipe, inputs: torch.Tensor, kwargs: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The reference's logits: the frozen copy, or the policy with its LoRA adapters off."""
    if recipe.reference_parts is not None:
        return recipe.reference_parts[0](inputs, **kwargs)
    with adapters_off(recipe.model_parts):
        return recipe.model_parts[0](inputs, **kwargs)


def policy_forward_backward(
    recipe: Recipe, batch: MicroBatch, observer: StepObserver
) -> torch.Tensor:
    """GRPO on a micro-batch of rollout rows: the reference's log-probabilities where the
    loss has a KL term (no gradient), then the policy's forward, loss and backward."""
    policy = recipe.policy
    observer.start_microbatch()
    with recipe.train_context():
        reference = None
        if policy.settings.beta != 0.0:
            observer.set_phase("reference forward")
            with torch.no_grad():
                reference = policy.logps(reference_logits(recipe, batch.inputs, {}), batch.labels)
        observer.set_phase("forward")
        logits = recipe.model_parts[0](batch.inputs)
        observer.set_phase("loss")
        loss = policy(logits, batch.labels, batch.advantages, reference)
        del logits
        observer.set_phase("backward")
        loss.backward()
    return loss.detach()


def pipeline_forward_backward(
    recipe: Recipe, batch: MicroBatch, observer: StepObserver
) -> torch.Tensor:
    """One local batch through the pipeline schedule; only the last stage has a loss (the
    sum of its micro-batches' shares), other stages report -1. Model kwargs (document ids,
    positions) are split into pipeline micro-batches and reach every stage."""
    inputs, labels, kwargs = model_inputs(
        batch, recipe.parallel_dims, recipe.job_config.training.reset_position_ids_per_document
    )
    return pipeline_step(recipe, inputs, labels, kwargs, observer)


def preference_pipeline_forward_backward(
    recipe: Recipe, batch: MicroBatch, observer: StepObserver
) -> torch.Tensor:
    """DPO under pipeline parallel: the reference's schedule, forward only, gives the last
    stage every row's token log-probs; the policy's schedule then runs with a target that
    carries them beside the labels and document ids (``pipeline_target``)."""
    inputs, labels, kwargs = model_inputs(
        batch, recipe.parallel_dims, recipe.job_config.training.reset_position_ids_per_document
    )
    reference = recipe.reference_pipeline
    outputs: list[torch.Tensor] = []
    targets = {"target": labels, "losses": outputs} if reference.has_last_stage else {}
    args = (inputs,) if reference.has_first_stage else ()
    observer.set_phase("reference forward")
    # Under LoRA the reference's stages are the policy's, run with the adapters off.
    lora = recipe.reference_parts is None
    adapters = adapters_off(recipe.model_parts) if lora else contextlib.nullcontext()
    with recipe.train_context(), torch.no_grad(), adapters:
        reference.schedule.eval(*args, return_outputs=False, **targets, **kwargs)
    if not reference.has_last_stage:
        return pipeline_step(recipe, inputs, labels, kwargs, observer)
    target = pipeline_target(labels, kwargs["document_ids"], torch.cat(outputs))
    calls_before = len(recipe.preference.metric_sums)
    loss = pipeline_step(recipe, inputs, target, kwargs, observer)
    recipe.preference.drop_stand_in_calls(calls_before, len(outputs))
    return loss


def pipeline_step(
    recipe: Recipe,
    inputs: torch.Tensor,
    target: torch.Tensor,
    kwargs: dict[str, torch.Tensor],
    observer: StepObserver,
) -> torch.Tensor:
    """``inputs`` (read by the first stage) and ``target`` (by the last stage's loss)
    through the training schedule."""
    pipeline = recipe.pipeline
    losses: list[torch.Tensor] = []
    targets = {"target": target, "losses": losses} if pipeline.has_last_stage else {}
    args = (inputs,) if pipeline.has_first_stage else ()
    observer.set_phase("pipeline schedule")
    with recipe.train_context():
        # return_outputs=False: the last stage would otherwise keep every micro-batch's
        # logits until the next step and concatenate them into a batch-sized copy.
        pipeline.schedule.step(*args, return_outputs=False, **targets, **kwargs)
    if not pipeline.has_last_stage:
        return torch.tensor(-1.0, device=recipe.device)
    return torch.sum(torch.stack([loss.detach() for loss in losses]))


def default_forward_backward(recipe: Recipe) -> ForwardBackward:
    if recipe.preference is not None:
        if recipe.pipeline is not None:
            return preference_pipeline_forward_backward
        return preference_forward_backward
    if recipe.policy is not None:
        return policy_forward_backward
    return pipeline_forward_backward if recipe.pipeline is not None else forward_backward


def data_ranks(parallel_dims: ParallelDims) -> int:
    """Ranks holding different tokens of a global batch: gradients are averaged over them."""
    return parallel_dims.dp_degree * parallel_dims.cp


def global_counts(recipe: Recipe, batches: list[MicroBatch]) -> tuple[torch.Tensor, ...]:
    """Valid labels of the whole global batch (and its preference pairs under DPO, its
    completions under GRPO): this rank's micro-batches, summed over the data-parallel ranks
    (cp ranks share their sequences). One all-reduce, no host sync."""
    counts = [torch.stack([valid_tokens(batch.labels) for batch in batches]).sum()]
    if recipe.preference is not None:
        counts.append(sum(count_pairs(batch.labels, batch.document_ids) for batch in batches))
    if recipe.policy is not None:
        counts.append(sum(count_completions(batch.labels) for batch in batches))
    totals = torch.stack([count.to(counts[0].dtype) for count in counts])
    if recipe.parallel_dims.dp_enabled:
        dist.all_reduce(totals, group=recipe.parallel_dims.world_mesh["dp"].get_group())
    return tuple(totals)


@dataclass
class StepResult:
    """What a step's forward and backward leave for the decision to apply it."""

    tokens: torch.Tensor
    """The global batch's valid tokens (a device tensor)."""
    losses: list[torch.Tensor]
    """Per micro-batch (one under fault-tolerant HSDP), detached; their sum is this rank's
    share of the global mean loss."""
    grad_norm: torch.Tensor
    """The pre-clip gradient norm."""
    committed: bool = True
    """Under fault-tolerant HSDP: whether enough replica groups took part to apply it."""

    @property
    def loss(self) -> torch.Tensor:
        """This rank's share of the loss (under loss parallel the local value of the
        replicated DTensor)."""
        local = [x.full_tensor() if isinstance(x, DTensor) else x for x in self.losses]
        return torch.stack(local).sum()


def compute_gradients(
    recipe: Recipe,
    next_batch: NextBatch,
    *,
    micro_batches: int | None = None,
    observer: StepObserver = UNOBSERVED,
    run_microbatch: ForwardBackward | None = None,
    replica_groups: ReplicaGroups | None = None,
) -> StepResult:
    """The step up to the optimizer: over ``micro_batches`` (default: the gradient
    accumulation steps), gradients of the global batch's mean loss, clipped.

    The step's micro-batches are fetched first: the loss divides by the valid tokens of the
    whole global batch. ``run_microbatch`` replaces the forward/backward of a micro-batch
    (the estimator's pipeline replay). Under fault-tolerant HSDP (``replica_groups``) the
    quorum comes first, token counts and gradients are summed / averaged over the live
    replica groups, and ``committed`` says whether the step may apply."""
    if run_microbatch is None:
        run_microbatch = default_forward_backward(recipe)
    replicas = replica_groups if replica_groups is not None and replica_groups.per_step else None
    observer.set_phase("zero_grad")
    recipe.optimizers.zero_grad()
    if replicas is not None:
        replicas.start_step()
    batches = [next_batch() for _ in range(micro_batches or recipe.grad_accum_steps)]
    # samples: DPO's preference pairs or GRPO's completions in the global batch
    tokens, *samples = global_counts(recipe, batches)
    ranks = data_ranks(recipe.parallel_dims)
    if replicas is not None:
        tokens = replicas.sum_tokens(tokens)
        ranks *= replicas.live_groups
    recipe.loss_fn.set_global_tokens(tokens, ranks)
    if recipe.preference is not None:
        recipe.preference.set_global_pairs(samples[0], ranks)
    if recipe.policy is not None:
        recipe.policy.set_global_counts(tokens, samples[0], ranks)
    losses = []
    while batches:
        losses.append(run_microbatch(recipe, batches.pop(0), observer))
    observer.set_phase("clip_grad_norm")
    params = [p for part in recipe.model_parts for p in part.parameters()]
    if replicas is not None:
        losses = [replicas.average_gradients_and_loss(params, losses)]
    grad_norm = clip_grad_norm_(
        params, recipe.job_config.training.max_norm, foreach=True, pp_mesh=recipe.pp_mesh
    )
    committed = replicas is None or replicas.should_commit()
    return StepResult(tokens, losses, grad_norm, committed)


def apply_step(recipe: Recipe, observer: StepObserver = UNOBSERVED) -> None:
    """The optimizer and LR step over the gradients ``compute_gradients`` left."""
    observer.set_phase("optimizer_step")
    recipe.optimizers.step()
    recipe.lr_schedulers.step()


def train_step(
    recipe: Recipe,
    next_batch: NextBatch,
    *,
    micro_batches: int | None = None,
    observer: StepObserver = UNOBSERVED,
    run_microbatch: ForwardBackward | None = None,
) -> None:
    """``compute_gradients`` then ``apply_step``, without the trainer's checks (the memory
    estimator's step). The gradient norm is freed before the optimizer runs, the losses
    and token count are not (the estimator's traced peaks rely on that)."""
    result = compute_gradients(
        recipe,
        next_batch,
        micro_batches=micro_batches,
        observer=observer,
        run_microbatch=run_microbatch,
    )
    held = (result.losses, result.tokens)
    del result
    apply_step(recipe, observer)
    del held
