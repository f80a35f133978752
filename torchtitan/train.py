"""The trainer: ``torchrun ... -m torchtitan.train --job.config_file F.toml [overrides]``.

It reads like the recipe it runs: ParallelDims -> world mesh -> determinism -> tokenizer ->
data loader -> model on meta -> converters -> parallelize -> init weights -> optimizers ->
LR schedulers -> metrics, then the training loop. No mesh is passed around: every builder
takes ``parallel_dims``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import rescale_accumulated_loss
from torchtitan.components.metrics import build_metrics_processor
from torchtitan.components.validate import PipelineEval
from torchtitan.config import ConfigError, ConfigManager, JobConfig
from torchtitan.config.entry import config_errors_exit
from torchtitan.config.preflight import preflight
from torchtitan.distributed.context_parallel import shard_batch_for_cp
from torchtitan.distributed.data_parallel import TORCH_DTYPES
from torchtitan.distributed.pipeline import loss_owner_rank
from torchtitan.distributed.parallel_dims import default_device_type
from torchtitan.distributed.utils import (
    clip_grad_norm_,
    dist_reduce,
    init_distributed,
    leave_together,
    set_determinism,
    set_pg_timeouts,
)
from torchtitan.models.moe import moe_load_metrics
from torchtitan.protocols import ModelConvertersContainer, get_train_spec
from torchtitan.tools.compile import compile_loss
from torchtitan.tools.logging import init_logger, logger, silence_non_logging_ranks
from torchtitan.tools.profiling import exit_after_profiled_run, maybe_enable_profiling, maybe_memory_snapshotter
from torchtitan.tools.utils import GarbageCollection


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    def __init__(self, job_config: JobConfig) -> None:
        self.job_config = job_config
        self.parallel_dims = preflight(
            job_config, int(os.environ.get("WORLD_SIZE", "1")), default_device_type()
        )
        parallel_dims = self.parallel_dims
        self.device = init_distributed(job_config)
        world_mesh = parallel_dims.world_mesh
        logger.info(f"parallel layout {parallel_dims.describe()}, mesh views {world_mesh.view_names}")

        self.gc_handler = GarbageCollection(job_config.training.gc_freq, job_config.training.gc_debug)
        self.seed = set_determinism(
            parallel_dims, self.device, job_config.debug.seed, job_config.debug.deterministic
        )
        self.train_spec = get_train_spec(job_config.model.name)
        spec = self.train_spec

        self.tokenizer = spec.build_tokenizer_fn(job_config) if spec.build_tokenizer_fn else None
        self.dataloader = spec.build_dataloader_fn(job_config, parallel_dims, self.tokenizer)

        model_args = spec.flavor_args(job_config.model.flavor)
        model_args.update_from_config(job_config, self.tokenizer)
        self.model_args = model_args
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        self.converters = ModelConvertersContainer(job_config, parallel_dims)
        self.converters.convert(model)
        nparams, self.flops_per_token = model_args.get_nparams_and_flops(model, job_config.training.seq_len)
        logger.info(
            f"model {job_config.model.name} {job_config.model.flavor}: {nparams:,} parameters, "
            f"{self.flops_per_token / 1e9:.3f} GFLOPs/token"
        )

        self.grad_accum_steps = self._grad_accumulation_steps()
        loss_fn = spec.build_loss_fn(job_config)
        if job_config.compile.enable and "loss" in job_config.compile.components:
            loss_fn = compile_loss(loss_fn, job_config.compile.backend)
        self.loss_fn = rescale_accumulated_loss(loss_fn, self.grad_accum_steps)

        self.pp_schedule = None
        self.pp_has_first_stage = self.pp_has_last_stage = True
        if parallel_dims.pp_enabled:
            if spec.pipelining_fn is None:
                raise ConfigError(f"parallelism.pipeline_parallel_degree: model {spec.name!r} has no pipelining support")
            pipeline = spec.pipelining_fn(
                model, parallel_dims, job_config, self.device, model_args,
                spec.parallelize_fn, self.loss_fn,
            )
            self.pp_schedule, self.model_parts = pipeline.schedule, pipeline.model_parts
            self.pp_has_first_stage, self.pp_has_last_stage = pipeline.has_first_stage, pipeline.has_last_stage
        else:
            self.model_parts = [spec.parallelize_fn(model, parallel_dims, job_config)]
        # With CPU offload FSDP keeps parameters on the CPU; buffers stay on the device.
        init_device = torch.device("cpu") if job_config.training.enable_cpu_offload else self.device
        for part in self.model_parts:
            part.to_empty(device=init_device)
            with torch.no_grad():
                part.init_weights(seed=self.seed, buffer_device=self.device)
            part.train()

        self.optimizers = spec.build_optimizers_fn(self.model_parts, job_config, parallel_dims)
        self.lr_schedulers = spec.build_lr_schedulers_fn(self.optimizers, job_config)
        self.optimizers.register_step_post_hook(
            lambda *args, **kwargs: self.converters.post_optimizer_hook(self.model_parts)
        )

        self.step = 0
        self.stop_requested = False
        self._install_preemption_handlers()
        self.amp_context = self._amp_context()
        compute_dtype = TORCH_DTYPES[job_config.training.mixed_precision_param]
        self.metrics = build_metrics_processor(
            job_config, parallel_dims, self.device, self.flops_per_token,
            owns_loss=self._owns_loss(), compute_dtype=compute_dtype,
        )
        self.loss_mesh = world_mesh["dp_cp"] if parallel_dims.dp_cp_enabled else None
        self.pp_mesh = world_mesh["pp"] if parallel_dims.pp_enabled else None

        self.checkpointer = CheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            job_config=job_config,
            parallel_dims=parallel_dims,
            train_spec=spec,
            model_args=model_args,
        )
        self.validator = None
        if job_config.validation.enable and spec.build_validator_fn is not None:
            self.validator = spec.build_validator_fn(
                job_config=job_config,
                parallel_dims=parallel_dims,
                tokenizer=self.tokenizer,
                loss_fn=spec.build_loss_fn(job_config),
                train_context=self.train_context,
                metrics_processor=self.metrics,
                pipeline=self._pipeline_eval(),
            )

    # ------------------------------------------------------------------ set-up helpers
    def _grad_accumulation_steps(self) -> int:
        training = self.job_config.training
        dp = self.parallel_dims.dp_degree
        per_pass = training.local_batch_size * dp
        global_batch = training.global_batch_size if training.global_batch_size > 0 else per_pass
        if global_batch % per_pass != 0:
            raise ConfigError(
                f"training.global_batch_size ({global_batch}) must be a multiple of "
                f"local_batch_size x data-parallel degree ({training.local_batch_size} x {dp} "
                f"= {per_pass})"
            )
        steps = global_batch // per_pass
        if steps > 1:
            logger.info(f"gradient accumulation: {steps} micro-batches per step (global batch {global_batch})")
        return steps

    def _pipeline_eval(self) -> PipelineEval | None:
        if self.pp_schedule is None:
            return None
        return PipelineEval(self.pp_schedule, self.pp_has_first_stage, self.pp_has_last_stage,
                            loss_scale=self.grad_accum_steps)

    def _amp_context(self):
        """FSDP casts parameters itself (MixedPrecisionPolicy); elsewhere use autocast."""
        dtype = TORCH_DTYPES[self.job_config.training.mixed_precision_param]
        if dtype == torch.float32:
            logger.info("mixed precision: off (float32)")
            return contextlib.nullcontext
        if self.parallel_dims.fsdp_enabled:
            logger.info(f"mixed precision: FSDP parameters in {dtype}, reduce in "
                        f"{self.job_config.training.mixed_precision_reduce}")
            return contextlib.nullcontext
        logger.info(f"mixed precision: autocast to {dtype} on {self.device.type}")
        return lambda: torch.autocast(self.device.type, dtype=dtype)

    @contextlib.contextmanager
    def train_context(self):
        """The context every forward (and backward) runs in: loss parallel under TP, and
        autocast where FSDP does not cast parameters itself."""
        with contextlib.ExitStack() as stack:
            if self.parallel_dims.tp_enabled and not self.job_config.parallelism.disable_loss_parallel:
                stack.enter_context(loss_parallel())
            stack.enter_context(self.amp_context())
            yield

    def _install_preemption_handlers(self) -> None:
        """A preemption signal only sets a flag; the per-step flag all-reduce makes every
        rank finish the step, save a checkpoint and exit 0 together."""
        def request_stop(signum, frame) -> None:
            logger.warning(f"received {signal.Signals(signum).name}; saving and stopping after this step")
            self.stop_requested = True

        for name in self.job_config.checkpoint.preemption_signals:
            if not hasattr(signal, name):
                raise ConfigError(f"checkpoint.preemption_signals: unknown signal {name!r}")
            signal.signal(getattr(signal, name), request_stop)

    def _owns_loss(self) -> bool:
        """The first rank holding the last pipeline stage (global rank 0 without PP); pp is
        the outermost mesh dim, so that is the lowest rank among those with the last stage."""
        return dist.get_rank() == loss_owner_rank(self.job_config, dist.get_world_size(), self.parallel_dims)

    # ------------------------------------------------------------------ the loop
    def next_batch(self, data_iterator) -> tuple[dict[str, torch.Tensor], torch.Tensor, float]:
        start = time.perf_counter()
        input_dict, labels = next(data_iterator)
        input_dict = {k: v.to(self.device, non_blocking=True) for k, v in input_dict.items()}
        labels = labels.to(self.device, non_blocking=True)
        return input_dict, labels, time.perf_counter() - start

    def forward_backward_step(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        if self.pp_schedule is not None:
            return self.pipeline_forward_backward(input_dict, labels)
        model = self.model_parts[0]
        inputs, positions = input_dict["input"], None
        if self.parallel_dims.cp_enabled:
            inputs, labels, positions = shard_batch_for_cp(
                inputs, labels, self.parallel_dims.world_mesh["cp"],
                self.job_config.parallelism.context_parallel_load_balancer,
            )
        with self.train_context():
            pred = model(inputs, positions=positions)
            loss = self.loss_fn(pred, labels)
            del pred
            loss.backward()
        loss = loss.detach()
        # Under loss parallel the loss is a replicated DTensor: take the local value.
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def pipeline_forward_backward(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """One local batch through the pipeline schedule; only the last stage has a loss
        (the mean over micro-batches), other stages report -1."""
        losses: list[torch.Tensor] = []
        targets = {"target": labels, "losses": losses} if self.pp_has_last_stage else {}
        inputs = (input_dict["input"],) if self.pp_has_first_stage else ()
        with self.train_context():
            # return_outputs=False: the last stage would otherwise keep every micro-batch's
            # logits until the next step and concatenate them into a batch-sized copy.
            self.pp_schedule.step(*inputs, return_outputs=False, **targets)
        if not self.pp_has_last_stage:
            return torch.tensor(-1.0, device=self.device)
        loss = torch.mean(torch.stack([l.detach() for l in losses]))
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def train_step(self, data_iterator) -> None:
        self.optimizers.zero_grad()
        losses, tokens, data_seconds = [], 0, 0.0
        for _ in range(self.grad_accum_steps):
            input_dict, labels, seconds = self.next_batch(data_iterator)
            tokens += labels.numel()
            data_seconds += seconds
            losses.append(self.forward_backward_step(input_dict, labels))
        self.metrics.record_step(tokens, data_seconds)

        grad_norm = clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
            pp_mesh=self.pp_mesh,
        )
        loss = torch.stack(losses).sum()
        nonfinite, stop = self._step_flags(loss, grad_norm)
        self.stop_requested = stop
        if nonfinite:
            return self._handle_nonfinite()
        lr = self.lr_schedulers.get_last_lr()  # the lr this step trains with
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()

        if self.metrics.should_log(self.step):
            self.metrics.log(
                self.step,
                loss=dist_reduce(loss, "avg", self.loss_mesh),
                loss_max=dist_reduce(loss, "max", self.loss_mesh),
                grad_norm=grad_norm.item(),
                lr=lr,
                extra=moe_load_metrics(self.model_parts),  # {} for dense models
            )

    def _step_flags(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        """The one per-step host sync: (non-finite, stop requested) all-reduced with MAX over
        all ranks, so that every rank skips, stops or saves at the same step."""
        stop = self.stop_requested or self.step == self.job_config.debug.stop_after_step
        flags = torch.stack([
            (~torch.isfinite(loss) | ~torch.isfinite(grad_norm)).float(),
            torch.tensor(float(stop), device=loss.device),
        ])
        if dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        nonfinite, stop_any = flags.tolist()
        return bool(nonfinite), bool(stop_any)

    def _handle_nonfinite(self) -> None:
        if self.job_config.training.skip_nonfinite_steps:
            logger.warning(f"step {self.step}: non-finite loss or grad norm; step skipped")
            self.optimizers.zero_grad()
            return
        raise NonFiniteLossError(
            f"step {self.step}: the loss or grad norm is not finite; lower optimizer.lr, check "
            "the data, or set training.skip_nonfinite_steps to skip such steps"
        )

    def train(self) -> None:
        job_config = self.job_config
        if job_config.checkpoint.create_seed_checkpoint:
            self.checkpointer.create_seed_checkpoint()
            return
        self.checkpointer.load(step=job_config.checkpoint.load_step)
        data_iterator = iter(self.dataloader)
        snapshotter = maybe_memory_snapshotter(job_config, self.device)
        logger.info(f"training {job_config.training.steps} steps (starting at step {self.step + 1})")
        with maybe_enable_profiling(job_config, self.step) as profiler:
            while self.step < job_config.training.steps:
                self.step += 1
                self.gc_handler.run(self.step)
                try:
                    self.train_step(data_iterator)
                except StopIteration:
                    logger.warning(f"data exhausted at step {self.step}; stopping")
                    self.step -= 1
                    break
                if self.validator is not None and self.validator.should_validate(self.step):
                    self.validator.validate(self.model_parts, self.step)
                if self.stop_requested:
                    self.checkpointer.save(self.step, force=True)
                    logger.warning(f"stopped after step {self.step} on request; checkpoint saved")
                    break
                self.checkpointer.save(self.step, last_step=self.step == job_config.training.steps)
                if profiler is not None:
                    profiler.step()
                if snapshotter is not None:
                    snapshotter.step(self.step)
                if self.step == 1:
                    set_pg_timeouts(job_config.comm.train_timeout_seconds, self.parallel_dims)
        logger.info("training completed")

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()
        self.gc_handler.close()


@record
@config_errors_exit
def main(argv: list[str] | None = None) -> None:
    init_logger()
    silence_non_logging_ranks(os.environ.get("LOG_RANK"))
    job_config = ConfigManager().parse_args(argv)
    if job_config.job.print_config:
        from torchtitan.config import config_to_toml

        logger.info("job config:\n" + config_to_toml(job_config))
    trainer = None
    try:
        trainer = Trainer(job_config)
        trainer.train()
        trainer.close()
        leave_together()
        if job_config.profiling.enable_profiling:
            exit_after_profiled_run(0)
    except NonFiniteLossError as e:
        logger.error(str(e))
        sys.exit(1)
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
