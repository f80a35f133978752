"""The trainer: ``torchrun ... -m torchtitan.train --job.config_file F.toml [overrides]``.

It runs the recipe (``torchtitan/recipe.py``: build order, train context, one training
step) shared with the memory estimator: ParallelDims -> world mesh -> determinism ->
tokenizer -> data loader -> the recipe's build -> metrics, checkpointing, validation, then
the training loop. No mesh is passed around: every builder takes ``parallel_dims``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from torchtitan.components.adapters.lora import LORA
from torchtitan.components.checkpointing.folders import saved_run_seed
from torchtitan.components.checkpointing.manager import CheckpointManager
from torchtitan.components.checkpointing.safe_loading import load_plain_state
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.preference_loss import metrics_from_sums
from torchtitan.components.rank_timeline import build_rank_timeline, build_straggler_plant
from torchtitan.components.validate import PipelineEval, Validator
from torchtitan.config import ConfigError, ConfigManager, JobConfig, save_config_file
from torchtitan.config.entry import config_errors_exit, exit_on_user_error
from torchtitan.config.errors import UserInputError
from torchtitan.data.micro_batch import DeviceBatches, PreparedBatches
from torchtitan.data.registry import load_documents
from torchtitan.distributed.fault_tolerance import (
    DataPositionFile,
    DataPositionSaves,
    ModelPartsState,
    ReplicaGroups,
    replica_dump_folder,
)
from torchtitan.distributed.hang_watchdog import build_hang_plant, build_hang_watchdog
from torchtitan.distributed.parallel_dims import ParallelDims, default_device_type
from torchtitan.distributed.pipeline import loss_owner_rank
from torchtitan.distributed.process import (
    TrainTimeouts,
    dist_reduce,
    init_distributed,
    leave_together,
    run_worker_entry_point,
    set_determinism,
)
from torchtitan.distributed.restarts import build_failure_plants, stop_on_crash_loop
from torchtitan.generation.rollouts import Rollouts, reduced_rollout_metrics
from torchtitan.layers.moe import moe_load_metrics
from torchtitan.preflight import load_tokenizer, local_gpu_capability, preflight
from torchtitan.protocols import TrainSpec, get_train_spec
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.recipe import (
    StepResult,
    apply_step,
    build_recipe,
    compute_gradients,
    grad_accumulation_steps,
    mixed_precision_summary,
    model_args_from_config,
    resolve_for_device,
)
from torchtitan.tools.cpu_allocator import maybe_keep_freed_cpu_memory
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.garbage_collection import GarbageCollection
from torchtitan.tools.logging import init_logger, logger, silence_non_logging_ranks
from torchtitan.tools.profiling import (
    ProfilerSteps,
    maybe_enable_profiling,
    maybe_memory_snapshotter,
)
from torchtitan.tools.step_hooks import StepHooks
from torchtitan.tools.storage import checkpoint_root


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    def __init__(self, job_config: JobConfig) -> None:
        self.job_config = job_config
        logger.info(f"starting job: {job_config.job.description}")
        for decision in resolve_for_device(job_config, default_device_type()):
            logger.info(decision)
        device_type = default_device_type()
        self.parallel_dims = preflight(
            job_config,
            int(os.environ.get("WORLD_SIZE", "1")),
            device_type,
            local_gpu_capability(device_type),
        )
        parallel_dims = self.parallel_dims
        self.device = init_distributed(
            job_config.comm, job_config.job.dump_folder, job_config.training.enable_cpu_offload
        )
        maybe_keep_freed_cpu_memory(job_config.training.cpu_keep_freed_memory, self.device)
        logger.info(
            f"parallel layout {parallel_dims.describe()}, "
            f"mesh views {parallel_dims.world_mesh.view_names}"
        )

        self.seed = set_determinism(
            parallel_dims,
            self.device,
            job_config.debug.seed,
            job_config.debug.deterministic,
            warn_only=job_config.debug.deterministic_warn_only,
            saved_seed=self._saved_seed(),
        )
        spec = get_train_spec(job_config.model.name)
        self.tokenizer = load_tokenizer(job_config.model)
        self.rollouts = self._build_rollouts(parallel_dims)
        self.dataloader = (
            None
            if self.rollouts is not None
            else spec.build_dataloader_fn(job_config.training, parallel_dims, self.tokenizer)
        )

        model_args = model_args_from_config(spec, job_config, self.tokenizer)
        # With CPU offload FSDP keeps parameters on the CPU; buffers stay on the device.
        init_device = torch.device("cpu") if job_config.training.enable_cpu_offload else self.device
        self.recipe = build_recipe(
            job_config,
            parallel_dims,
            spec,
            model_args,
            self.device,
            seed=self.seed,
            init_device=init_device,
        )
        recipe = self.recipe
        self.model_parts, self.optimizers, self.lr_schedulers = (
            recipe.model_parts,
            recipe.optimizers,
            recipe.lr_schedulers,
        )
        self._log_recipe()

        self.step = 0
        """The last step done (what a checkpoint saves)."""
        self.step_in_flight: int | None = None
        self.stop_requested = False
        self._install_preemption_handlers()
        self.metrics = self._build_metrics()
        self.timeline = build_rank_timeline(
            job_config.metrics, job_config.job.dump_folder, self.device
        )
        self.checkpointer = self._build_checkpointer(spec, model_args)
        self.replicas = self._build_replica_groups()
        self.validator = self._build_validator(spec)
        self.hooks = self._build_step_hooks()

    # ------------------------------------------------------------------ set-up helpers
    def _saved_seed(self) -> int | None:
        """Rank 0, with no debug.seed: the seed of the checkpoint this run resumes."""
        checkpoint = self.job_config.checkpoint
        if self.job_config.debug.seed is not None or not checkpoint.enable:
            return None
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        root = checkpoint_root(checkpoint.folder, self.job_config.job.dump_folder)
        return saved_run_seed(root, checkpoint.load_step)

    def _build_rollouts(self, parallel_dims: ParallelDims) -> Rollouts | None:
        """GRPO: the prompts and the rollouts sampled from them each step (no data loader)."""
        job_config = self.job_config
        if not job_config.grpo.enable:
            return None
        training = job_config.training
        try:
            _, prompts = load_documents(training.dataset, training.dataset_path)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
        return Rollouts(
            job_config.grpo,
            list(prompts),
            self.tokenizer,
            training.seq_len,
            grad_accumulation_steps(training, parallel_dims)
            * training.local_batch_size
            * parallel_dims.dp_degree,
            training.local_batch_size,
            parallel_dims,
            self.device,
            self.seed,
            Path(job_config.job.dump_folder) / "rollouts",
        )

    def _build_checkpointer(self, spec: TrainSpec, model_args: BaseModelArgs) -> CheckpointManager:
        job_config = self.job_config
        return CheckpointManager(
            job_config.checkpoint,
            dump_folder=job_config.job.dump_folder,
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            parallel_dims=self.parallel_dims,
            state_dict_adapter=spec.hf_adapter(model_args, job_config.model.hf_assets_path),
            lora=job_config.lora if LORA in job_config.model.converters else None,
            pending_base=self.recipe.pending_base,
        )

    def _build_metrics(self) -> MetricsProcessor:
        job_config = self.job_config
        return MetricsProcessor(
            job_config.metrics,
            dump_folder=job_config.job.dump_folder,
            total_steps=job_config.training.steps,
            parallel_dims=self.parallel_dims,
            device=self.device,
            flops_per_token=self.recipe.flops_per_token,
            owns_loss=self._owns_loss(),
            compute_dtype=TORCH_DTYPES[job_config.training.mixed_precision_param],
            run_config=dataclasses.asdict(job_config),
            description=job_config.job.description,
        )

    def _build_validator(self, spec: TrainSpec) -> Validator | None:
        job_config = self.job_config
        if not job_config.validation.enable or spec.build_validator_fn is None:
            return None
        return spec.build_validator_fn(
            validation=job_config.validation,
            reset_positions=job_config.training.reset_position_ids_per_document,
            parallel_dims=self.parallel_dims,
            tokenizer=self.tokenizer,
            loss_fn=self.recipe.loss_fn.loss_sum,
            train_context=self.recipe.train_context,
            metrics_processor=self.metrics,
            pipeline=self._pipeline_eval(),
        )

    def _build_step_hooks(self) -> StepHooks:
        """In the order they act at each point of a step: garbage collection and the failure
        plants first, the watchdog, the timeline (a straggler plant waits in its data
        phase), the hang plant before the step's sync, then what ends a committed step."""
        job_config, rank = self.job_config, self.parallel_dims.world_mesh.get_rank()
        data_position = self.data_position
        return StepHooks(
            [
                GarbageCollection(job_config.training.gc_freq, job_config.training.gc_debug),
                *build_failure_plants(job_config.debug, rank),
                build_hang_watchdog(job_config.comm, job_config.job.dump_folder, self.device.type),
                self.timeline,
                build_straggler_plant(self.timeline, job_config.debug),
                build_hang_plant(job_config.debug, rank),
                DataPositionSaves(data_position, self.dataloader) if data_position else None,
                TrainTimeouts(job_config.comm.train_timeout_seconds, self.parallel_dims),
            ]
        )

    def _build_replica_groups(self) -> ReplicaGroups | None:
        """Fault tolerance: the torchft manager, what a healing peer receives, and this
        rank's data-position file (with checkpointing and enable_ft_dataloader_checkpoints)."""
        job_config = self.job_config
        self.data_position = None
        if not job_config.fault_tolerance.enable:
            return None
        replicas = ReplicaGroups(
            job_config.fault_tolerance, job_config.comm, self.device, load_plain_state
        )
        replicas.register_states(
            {
                "model": ModelPartsState(self.model_parts),
                "optimizer": self.optimizers,
                "lr_scheduler": self.lr_schedulers,
                "train_state": self,
            }
        )
        if job_config.checkpoint.enable and job_config.checkpoint.enable_ft_dataloader_checkpoints:
            self.data_position = DataPositionFile(self.checkpointer.root, dist.get_rank())
        return replicas

    def _log_recipe(self) -> None:
        recipe, job_config = self.recipe, self.job_config
        logger.info(
            f"model {job_config.model.name} {job_config.model.flavor}: "
            f"{recipe.nparams:,} parameters, {recipe.flops_per_token / 1e9:.3f} GFLOPs/token"
        )
        if recipe.grad_accum_steps > 1:
            logger.info(f"gradient accumulation: {recipe.grad_accum_steps} micro-batches per step")
        logger.info(
            mixed_precision_summary(job_config.training, self.parallel_dims, self.device.type)
        )

    def _pipeline_eval(self) -> PipelineEval | None:
        pipeline = self.recipe.pipeline
        if pipeline is None:
            return None
        return PipelineEval(
            pipeline.schedule,
            pipeline.has_first_stage,
            pipeline.has_last_stage,
            self.recipe.loss_fn,
        )

    def _install_preemption_handlers(self) -> None:
        """A preemption signal only sets a flag; the per-step flag all-reduce makes every
        rank finish the step, save a checkpoint and exit 0 together."""

        def request_stop(signum, frame) -> None:
            logger.warning(
                f"received {signal.Signals(signum).name}; saving and stopping after this step"
            )
            self.stop_requested = True

        for name in self.job_config.checkpoint.preemption_signals:  # names checked with the config
            signal.signal(getattr(signal, name), request_stop)

    def _owns_loss(self) -> bool:
        """The first rank holding the last pipeline stage (global rank 0 without PP)."""
        return self.parallel_dims.world_mesh.get_rank() == loss_owner_rank(
            self.job_config.parallelism, self.parallel_dims
        )

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        job_config = self.job_config
        if job_config.checkpoint.create_seed_checkpoint:
            self.checkpointer.create_seed_checkpoint()
            return
        data_iterator = self._resume()
        steps = job_config.training.steps
        logger.info(f"training {steps} steps (starting at step {self.step + 1})")
        with self._training_hooks() as hooks:
            while self.step < steps:
                step = self.step_in_flight = self.step + 1
                hooks.step_started(step)
                result = self.run_step(step, data_iterator)
                if result is None:
                    break
                hooks.step_finished(step)
                if result.committed and self.close_step(step):
                    break
                hooks.step_closed(step, result.committed)
        logger.info("training completed")

    def _resume(self) -> Iterator:
        """The newest checkpoint (or the seeded QLoRA base), the data position of a replica
        group that lost its peers, the replica groups' step; the data from there on."""
        self.checkpointer.load(step=self.job_config.checkpoint.load_step)
        if self.recipe.reference_parts is not None:
            self.checkpointer.load_initial_weights(self.recipe.reference_parts)
        if self.recipe.pending_base is not None:  # QLoRA without a base to load: seeded
            self.recipe.pending_base.fill(None)
        if self.data_position is not None:
            self.data_position.load_newer(self.step, self.dataloader)
        if self.replicas is not None and self.replicas.per_step:
            self.replicas.align_step(self.step)
        return iter(self.dataloader) if self.dataloader is not None else iter(())

    @contextlib.contextmanager
    def _training_hooks(self) -> Iterator[StepHooks]:
        """The step hooks plus those that live for one ``train()``: the profiler, memory
        snapshots, and DiLoCo / LocalSGD's synchronisation around the loop."""
        job_config = self.job_config
        semi_sync = (
            self.replicas.semi_sync_context(self.model_parts, self.optimizers)
            if self.replicas is not None
            else contextlib.nullcontext()
        )
        profiling = maybe_enable_profiling(
            job_config.profiling, job_config.job.dump_folder, self.step
        )
        with profiling as profiler, semi_sync:
            yield StepHooks(
                [
                    *self.hooks.hooks,
                    ProfilerSteps(profiler) if profiler is not None else None,
                    maybe_memory_snapshotter(
                        job_config.profiling, job_config.job.dump_folder, self.device
                    ),
                ]
            )

    def run_step(self, step: int, data_iterator: Iterator) -> StepResult | None:
        """Step ``step``: gradients, the step's flags, the optimizer (unless the flags say
        no) and the metrics line. None when the data ran out. A step the replica groups did
        not commit leaves ``self.step`` where it was: the next call runs it again."""
        if self.rollouts is not None:
            batches: DeviceBatches | PreparedBatches = self._rollout_batches(step)
        else:
            batches = DeviceBatches(
                data_iterator, self.device, self.recipe.grad_accum_steps, self.timeline.mark
            )
        try:
            result = compute_gradients(
                self.recipe, batches, observer=self.timeline, replica_groups=self.replicas
            )
        except StopIteration:
            logger.warning(f"data exhausted at step {step}; stopping")
            return None
        self.metrics.record_step(batches.tokens, batches.seconds)
        if not result.committed:
            logger.warning(
                f"step {step}: not committed (fewer than fault_tolerance.min_replica_size "
                "replica groups took part, or one failed during it); "
                "running it again on the next batch"
            )
            return result
        self.step = step
        lr = self._apply(step, result)
        if lr is not None and self.metrics.should_log(step):
            self._log(step, result, lr)
        return result

    def _rollout_batches(self, step: int) -> PreparedBatches:
        """GRPO: the step's rollouts, sampled now from the weights being trained, served as
        its micro-batches (their sampling counts as the step's data time)."""
        self.timeline.mark("data")
        batches = self.rollouts.step_batches(self.model_parts[0], step)
        self.timeline.mark("sync")
        return PreparedBatches(batches, self.rollouts.stats.seconds)

    def _apply(self, step: int, result: StepResult) -> float | None:
        """The step's flags (non-finite, stop), then the optimizer step unless they say
        skip; the lr the step trained with, None when skipped."""
        self.timeline.mark("sync")
        loss = result.loss
        self.hooks.before_sync(step)
        nonfinite, self.stop_requested = self._step_flags(step, loss, result.grad_norm)
        if nonfinite:
            self._handle_nonfinite(step)
            return None
        lr = self.lr_schedulers.get_last_lr()
        self.timeline.mark("checkpoint")
        self.checkpointer.maybe_wait_for_staging()
        apply_step(self.recipe, self.timeline)
        return lr

    def _log(self, step: int, result: StepResult, lr: float) -> None:
        parallel_dims = self.parallel_dims
        loss_mesh = parallel_dims.world_mesh["dp_cp"] if parallel_dims.dp_cp_enabled else None
        loss = result.loss
        self.metrics.log(
            step,
            loss=dist_reduce(loss, "avg", loss_mesh),
            loss_max=dist_reduce(loss, "max", loss_mesh),
            grad_norm=result.grad_norm.item(),
            lr=lr,
            extra={
                "valid_tokens": int(result.tokens.item()),
                **moe_load_metrics(self.model_parts),  # no MoE metrics for dense models
                **self._preference_metrics(),
                **self._rollout_metrics(),
                **self._data_metrics(),
                **(self.replicas.metrics(step) if self.replicas is not None else {}),
                **self.timeline.gather_metrics(),
            },
        )

    def _preference_metrics(self) -> dict[str, float]:
        """DPO's rewards, margins and accuracy over the global batch (one all-reduce at
        logging steps)."""
        if self.recipe.preference is None:
            return {}
        sums = self.recipe.preference.step_metric_sums(self.device)
        if self.parallel_dims.dp_enabled:
            dist.all_reduce(sums, group=self.parallel_dims.world_mesh["dp"].get_group())
        return metrics_from_sums(sums)

    def _rollout_metrics(self) -> dict[str, float]:
        """GRPO's rewards, completion lengths and rollout speed over the global batch."""
        if self.rollouts is None:
            return {}
        return reduced_rollout_metrics(self.rollouts.stats, self.parallel_dims, self.device)

    def close_step(self, step: int) -> bool:
        """Validation and the checkpoint of a committed step; True when a stop was requested
        (the checkpoint is then forced and training ends)."""
        if self.validator is not None and self.validator.should_validate(step):
            self.timeline.mark("validation")
            self.validator.validate(self.model_parts, step)
        if self.stop_requested:
            self.checkpointer.save(step, force=True)
            logger.warning(f"stopped after step {step} on request; checkpoint saved")
            return True
        self.timeline.mark("checkpoint")
        self.checkpointer.save(step, last_step=step == self.job_config.training.steps)
        return False

    def _data_metrics(self) -> dict[str, float]:
        """A mixture's tokens per source (a custom loader may have none)."""
        metrics = getattr(self.dataloader, "metrics", None)
        return metrics() if metrics is not None else {}

    def _step_flags(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor
    ) -> tuple[bool, bool]:
        """The one per-step host sync: (non-finite, stop requested) all-reduced with MAX over
        all ranks, so that every rank skips, stops or saves at the same step."""
        stop = self.stop_requested or step == self.job_config.debug.stop_after_step
        flags = torch.stack(
            [
                (~torch.isfinite(loss) | ~torch.isfinite(grad_norm)).float(),
                torch.tensor(float(stop), device=loss.device),
            ]
        )
        if self.parallel_dims.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        nonfinite, stop_any = flags.tolist()
        return bool(nonfinite), bool(stop_any)

    def _handle_nonfinite(self, step: int) -> None:
        if self.job_config.training.skip_nonfinite_steps:
            logger.warning(f"step {step}: non-finite loss or grad norm; step skipped")
            self.optimizers.zero_grad()
            return
        raise NonFiniteLossError(
            f"step {step}: the loss or grad norm is not finite; lower optimizer.lr, check "
            "the data, or set training.skip_nonfinite_steps to skip such steps"
        )

    def running_step(self) -> int:
        """The step in flight (the last one done between steps, 0 before the first)."""
        return self.step_in_flight if self.step_in_flight is not None else self.step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        saved = state_dict.get("seed")
        if saved is not None and saved != self.seed:
            logger.warning(
                f"debug.seed={self.seed} but the resumed checkpoint was trained with seed "
                f"{saved}: what the seed alone decides (a reference or LoRA base without "
                "initial weights, GRPO's rollouts) differs from the run before the stop; "
                f"unset debug.seed or set it to {saved} to continue that run"
            )

    def close(self) -> None:
        self.hooks.close()
        self.hooks = StepHooks([])
        if self.replicas is not None:
            self.replicas.shutdown()
            self.replicas = None
        self.checkpointer.close()
        self.metrics.close()


@record
@config_errors_exit
def main(argv: list[str] | None = None) -> None:
    init_logger()
    silence_non_logging_ranks(os.environ.get("LOG_RANK"))
    job_config = ConfigManager().parse_args(argv)
    if job_config.fault_tolerance.enable:
        job_config.job.dump_folder = replica_dump_folder(
            job_config.job.dump_folder, job_config.fault_tolerance.replica_id
        )
    if job_config.job.print_config:
        from torchtitan.config import config_to_toml

        logger.info("job config:\n" + config_to_toml(job_config))
    if int(os.environ.get("RANK", "0")) == 0 and (saved := save_config_file(job_config)):
        logger.info(f"job config written to {saved}")
    trainer = None
    try:
        trainer = Trainer(job_config)
        trainer.train()
        trainer.close()
        leave_together()
    except NonFiniteLossError as e:
        logger.error(str(e))
        sys.exit(1)
    except UserInputError as e:
        exit_on_user_error(str(e))  # before the process group goes: peers then see the record
    except Exception:
        step = trainer.running_step() if trainer is not None else 0  # 0: while setting up
        stop_on_crash_loop(step, job_config.checkpoint.max_failures_at_same_step)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_worker_entry_point(main)
