"""The checks that need the world size, the model, the device or the disk, run once before
any process group exists (by run_train.sh through ``python -m torchtitan.preflight --world-size
N``, by the trainer and by the memory estimator), so bad input fails with one line instead of
one traceback per rank: ``preflight`` checks the layout for a world size, the model and the
device, ``check_inputs`` the data, tokenizer, converters, checkpoint and device features. Each
check takes the sections it reads. It sits above ``config/`` (where a check that reads only
the config's own values lives, beside its field) and the layers whose rules it applies."""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch._dynamo import list_backends

from torchtitan.components.adapters.lora import LORA, select_targets
from torchtitan.components.adapters.qlora import FIELD as QLORA_FIELD
from torchtitan.components.adapters.qlora import LOW_PRECISION_CONVERTERS, check_qlora, uses_nf4
from torchtitan.components.checkpointing.folders import check_checkpoint_inputs
from torchtitan.components.quantization import check_quantization
from torchtitan.components.rewards import get_reward
from torchtitan.config import (
    CheckpointConfig,
    CompileConfig,
    ConfigError,
    ConfigManager,
    DebugConfig,
    JobConfig,
    LoRAConfig,
    ModelConfig,
    ParallelismConfig,
    ProfilingConfig,
    TrainingConfig,
    ValidationConfig,
)
from torchtitan.config.entry import config_errors_exit
from torchtitan.data.registry import (
    check_dataset_fields,
    get_dataset_config,
    registered_datasets,
)
from torchtitan.data.token_loaders import (
    MIXTURE,
    TOKENS,
    open_store,
    source_configs,
    uses_sources,
)
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.context_parallel.attention import check_cp_config
from torchtitan.distributed.fault_tolerance import check_fault_tolerance_inputs
from torchtitan.distributed.parallel_dims import default_device_type, parallel_dims_from_config
from torchtitan.distributed.pipeline import (
    is_v_shaped,
    loss_owner_rank,
    microbatches,
    plan_stages,
)
from torchtitan.protocols import BaseModelArgs, TrainSpec, get_train_spec
from torchtitan.protocols.model_converter import check_converter_names
from torchtitan.protocols.tokenizer import BaseTokenizer
from torchtitan.recipe import grad_accumulation_steps, max_seq_len
from torchtitan.tools.logging import logger


def local_gpu_capability(device_type: str) -> tuple[int, int] | None:
    """This machine's GPU (major, minor) compute capability for a CUDA run, else None."""
    return torch.cuda.get_device_capability() if device_type == "cuda" else None


def preflight(
    job_config: JobConfig,
    world_size: int,
    device_type: str,
    gpu_capability: tuple[int, int] | None = None,
) -> ParallelDims:
    """Validate the parallel layout for this config, world size and device (for CUDA, of
    ``gpu_capability``; None: a GPU not known yet, whose capability checks are left to the
    run); return the ParallelDims (not yet holding a mesh)."""
    try:
        parallel_dims = parallel_dims_from_config(
            job_config.parallelism, job_config.fault_tolerance, world_size
        )
        spec = get_train_spec(job_config.model.name)
        model_args = spec.flavor_args(job_config.model.flavor)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model_args.update_from_config(  # the tokenizer's vocabulary does not matter here
        job_config.model,
        max_seq_len=max_seq_len(job_config.training, job_config.validation),
        moe_force_load_balance=job_config.debug.moe_force_load_balance,
    )
    model_args.check_parallelism(parallel_dims)
    model, training, parallelism = job_config.model, job_config.training, job_config.parallelism
    _check_layout(training, job_config.validation, parallelism, parallel_dims, model_args)
    _check_model_support(model, job_config.compile, parallelism, spec, model_args, parallel_dims)
    check_quantization(
        model, job_config.quantize, parallel_dims, model_args, device_type, gpu_capability
    )
    _check_hf_export(job_config.checkpoint, spec, model_args)
    _check_lora(model.converters, job_config.lora, spec, model_args, parallel_dims)
    _check_dpo(job_config, parallel_dims)
    _check_grpo(job_config, parallel_dims)
    _check_world_size(job_config.checkpoint, job_config.debug, world_size)
    _check_device_options(training, parallelism, parallel_dims, device_type)
    return parallel_dims


def _check_lora(
    converters: list[str],
    lora: LoRAConfig,
    spec: TrainSpec,
    model_args: BaseModelArgs,
    parallel_dims: ParallelDims,
) -> None:
    """``lora.target_modules`` selects linears of this model (on the meta device: no memory)
    and an NF4 base suits them and the layout."""
    if LORA not in converters:
        if uses_nf4(lora):
            raise ConfigError(f'{QLORA_FIELD}: "nf4" needs "lora" in model.converters')
        return
    later = [c for c in converters[converters.index(LORA) + 1 :] if c in LOW_PRECISION_CONVERTERS]
    if later:
        ordered = later + [c for c in converters if c not in later]
        raise ConfigError(
            f"model.converters: {later[0]!r} after 'lora' would replace the adapted linears and "
            f"drop their adapters; list it first: {ordered}"
        )
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    check_qlora(lora, converters, parallel_dims, select_targets(model, lora.target_modules))


def _check_dpo(job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """DPO trains on preference pairs and only on them; the layouts it does not run yet are
    refused in one line."""
    training, dpo = job_config.training, job_config.dpo
    preference = (
        training.dataset in registered_datasets()
        and get_dataset_config(training.dataset).preference
    )
    if preference and not dpo.enable:
        raise ConfigError(
            f"training.dataset={training.dataset!r} holds preference pairs, which train with "
            "the DPO loss: set dpo.enable = true"
        )
    if not dpo.enable:
        return
    if not preference:
        raise ConfigError(
            f"dpo.enable: training.dataset={training.dataset!r} has no preference pairs; use "
            "dataset 'preference' (jsonl rows with prompt, chosen, rejected)"
        )
    if job_config.model.attn_mask_type != "block_causal":
        raise ConfigError(
            "dpo.enable: a packed sequence holds several pairs, each completion must see only "
            "its own prompt; set model.attn_type = 'flex' and model.attn_mask_type = "
            "'block_causal'"
        )
    if not training.reset_position_ids_per_document:
        raise ConfigError(
            "dpo.enable: each sequence of a pair starts at position 0 (as TRL and inference "
            "see it); set training.reset_position_ids_per_document = true"
        )
    if parallel_dims.cp > 1 and parallel_dims.pp_enabled:
        raise ConfigError(
            "dpo.enable: context parallel with pipeline parallel is not supported with DPO yet; "
            "use one of them"
        )
    if parallel_dims.pp_enabled and is_v_shaped(job_config.parallelism):
        raise ConfigError(
            f"dpo.enable: the reference's forward-only pass cannot run under the V-shaped "
            f"parallelism.pipeline_parallel_schedule "
            f"{job_config.parallelism.pipeline_parallel_schedule!r}; use 1F1B, GPipe, "
            "Interleaved1F1B, LoopedBFS or InterleavedZeroBubble"
        )
    if job_config.validation.enable:
        raise ConfigError(
            "dpo.enable: validation has no DPO loss yet; set validation.enable = false"
        )
    if job_config.fault_tolerance.enable:
        raise ConfigError(
            "dpo.enable: fault tolerance is not supported with DPO yet; unset "
            "fault_tolerance.enable"
        )


def _check_grpo(job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """GRPO samples its rollouts from prompts and only from them; what it does not run yet is
    refused in one line."""
    training, grpo = job_config.training, job_config.grpo
    prompts = (
        training.dataset in registered_datasets() and get_dataset_config(training.dataset).prompts
    )
    if prompts and not grpo.enable:
        raise ConfigError(
            f"training.dataset={training.dataset!r} holds prompts for rollouts: set "
            "grpo.enable = true"
        )
    if not grpo.enable:
        return
    if not prompts:
        raise ConfigError(
            f"grpo.enable: training.dataset={training.dataset!r} has no prompts; use dataset "
            "'prompts' (jsonl rows with a prompt and the columns the rewards read)"
        )
    if job_config.dpo.enable:
        raise ConfigError("grpo.enable: dpo.enable is set too; choose one")
    for name in grpo.reward_funcs:
        try:
            get_reward(name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    unsupported = {
        "pipeline parallel": parallel_dims.pp > 1,
        "context parallel": parallel_dims.cp > 1,
        "expert parallel": parallel_dims.ep > 1,
        "compile": job_config.compile.enable,
        "validation": job_config.validation.enable,
        "fault tolerance": job_config.fault_tolerance.enable,
    }
    for name, asked in unsupported.items():
        if asked:
            raise ConfigError(
                f"grpo.enable: {name} is not supported with GRPO yet (its rollouts decode "
                "through the sharded model); use FSDP/HSDP, DDP or TP"
            )
    per_pass = training.local_batch_size * parallel_dims.dp_degree
    global_batch = grad_accumulation_steps(training, parallel_dims) * per_pass
    groups = grpo.num_generations * parallel_dims.dp_degree
    if global_batch % groups:
        raise ConfigError(
            f"training.global_batch_size={global_batch}: counts completions, a multiple of "
            f"grpo.num_generations ({grpo.num_generations}) x the data-parallel degree "
            f"({parallel_dims.dp_degree}), so every rank samples whole groups"
        )


def _check_layout(
    training: TrainingConfig,
    validation: ValidationConfig,
    parallelism: ParallelismConfig,
    parallel_dims: ParallelDims,
    model_args: BaseModelArgs,
) -> None:
    """Sequence splits, DDP with TP, context and pipeline parallel, the batch sizes."""
    if training.seq_len % parallel_dims.seq_len_divisor != 0:
        raise ConfigError(
            f"training.seq_len ({training.seq_len}) must be divisible by tp * 2 * cp = "
            f"{parallel_dims.seq_len_divisor} (sequence parallel and context-parallel load "
            "balancing split the sequence)"
        )
    if (
        parallel_dims.dp_replicate_enabled
        and not parallel_dims.fsdp_enabled
        and parallel_dims.tp_enabled
    ):
        # torch's replicate() leaves DTensor (TP) gradients unsynchronised: refuse, never
        # train silently wrong.
        raise ConfigError(
            "DDP (data_parallel_replicate_degree > 1 with data_parallel_shard_degree 1) does not "
            "compose with tensor_parallel_degree > 1; use HSDP (data_parallel_shard_degree >= 2) "
            "or FSDP with TP"
        )
    if parallel_dims.cp_enabled:
        seq_lens = {"training.seq_len": training.seq_len}
        if validation.enable:
            seq_lens["validation.seq_len"] = validation.seq_len
        _check_context_parallel(parallelism, seq_lens, parallel_dims, model_args.n_heads)
    if parallel_dims.pp_enabled:
        plan = plan_stages(parallelism, model_args.n_layers, parallel_dims.pp)
        microbatches(parallelism, training.local_batch_size, plan.num_stages)
    grad_accumulation_steps(training, parallel_dims)
    if validation.enable:
        _check_validation(validation, training, parallel_dims)


def _check_model_support(
    model: ModelConfig,
    compile: CompileConfig,
    parallelism: ParallelismConfig,
    spec: TrainSpec,
    model_args: BaseModelArgs,
    parallel_dims: ParallelDims,
) -> None:
    """What this model cannot do yet: pipeline stages without a pipelining function, and
    async TP with MoE layers."""
    if parallel_dims.pp_enabled and spec.pipelining_fn is None:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree: model {spec.name!r} has no pipelining support"
        )
    if getattr(model_args, "moe", None) is None:
        return
    what = f"{spec.name} {model.flavor}"
    if parallelism.enable_async_tensor_parallel:
        raise ConfigError(
            f"parallelism.enable_async_tensor_parallel: not supported for {what} yet: "
            "inductor's micro-pipeline pass over blocks compiled around the experts' "
            "all-to-alls has not been run on 2+ CUDA GPUs here; use plain TP"
        )


def _check_world_size(checkpoint: CheckpointConfig, debug: DebugConfig, world_size: int) -> None:
    """A seed checkpoint is written by one process; a planted failure names a rank of the run."""
    if checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint: run it on 1 process (NGPU=1, all parallel "
            f"degrees 1), got {world_size} processes; any layout loads the seed later"
        )
    for field, rank, planted in (
        ("fail_on_rank", debug.fail_on_rank, True),
        ("hang_on_rank", debug.hang_on_rank, debug.hang_at_step is not None),
        ("straggler_rank", debug.straggler_rank, debug.straggler_rank is not None),
    ):
        if planted and not 0 <= rank < world_size:
            raise ConfigError(
                f"debug.{field}: must name one of the {world_size} ranks "
                f"(0 to {world_size - 1}), got {rank}"
            )


def _check_device_options(
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    parallel_dims: ParallelDims,
    device_type: str,
) -> None:
    """CPU offload needs an accelerator and FSDP; async TP needs CUDA."""
    if training.enable_cpu_offload and device_type == "cpu":
        raise ConfigError(
            "training.enable_cpu_offload: offloads accelerator memory to the CPU, but this run "
            "already trains on the CPU; leave it off"
        )
    if training.enable_cpu_offload and not parallel_dims.fsdp_enabled:
        raise ConfigError(
            "training.enable_cpu_offload: needs FSDP (data_parallel_shard_degree > 1), which "
            "does the offloading"
        )
    if parallelism.enable_async_tensor_parallel and device_type != "cuda":
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel: needs CUDA (symmetric memory); this "
            f"machine runs on {device_type}"
        )


def load_tokenizer(model: ModelConfig) -> BaseTokenizer | None:
    """The run's tokenizer, built by its train spec (None if the model has none); a
    ``model.tokenizer_path`` that holds no usable tokenizer is a ConfigError."""
    spec = get_train_spec(model.name)
    if spec.build_tokenizer_fn is None:
        return None
    try:
        return spec.build_tokenizer_fn(model)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None


def _check_hf_export(
    checkpoint: CheckpointConfig, spec: TrainSpec, model_args: BaseModelArgs
) -> None:
    """With ``checkpoint.last_save_in_hf``, fail before launch, not after training, when the
    model has no Hugging Face equivalent (e.g. a softmax-routed DeepSeek-V3 flavor)."""
    if not (checkpoint.enable and checkpoint.last_save_in_hf):
        return
    field = "checkpoint.last_save_in_hf"
    adapter = spec.hf_adapter(model_args)
    if adapter is None:
        raise ConfigError(f"{field}: this model has no Hugging Face state-dict adapter")
    try:
        adapter.hf_config()
    except (ValueError, NotImplementedError) as e:
        raise ConfigError(f"{field}: {e}") from None


def _check_cuda_only(
    training: TrainingConfig, profiling: ProfilingConfig, compile: CompileConfig, device_type: str
) -> None:
    """Features that only work on CUDA: (field, whether the config uses it, what needs CUDA)."""
    cuda_only = [
        (
            "training.dataloader.pin_memory",
            training.dataloader.pin_memory,
            "page-locked batches for host-to-GPU copies",
        ),
        (
            "profiling.enable_memory_snapshot",
            profiling.enable_memory_snapshot,
            "snapshots of the CUDA caching allocator",
        ),
        ("compile.backend", compile.enable and compile.backend == "cudagraphs", "CUDA graphs"),
    ]
    for field, in_use, what in cuda_only:
        if in_use and device_type != "cuda":
            raise ConfigError(
                f"{field}: needs CUDA ({what}); this machine runs on {device_type}; leave it off"
            )


def _check_compile_backend(compile: CompileConfig) -> None:
    if compile.enable and compile.backend not in list_backends(exclude_tags=()):
        raise ConfigError(
            f"compile.backend: unknown backend {compile.backend!r}; valid: "
            f"{', '.join(list_backends())} (and debug backends such as eager, aot_eager)"
        )


def check_inputs(job_config: JobConfig, device_type: str) -> None:
    """The checks that read the disk, a registry or the machine, made once before launch: the
    data sets, the tokenizer, the model converters, the checkpoint to resume or start from and
    the features this device cannot run."""
    sections = [("training", job_config.training)]
    if job_config.validation.enable:
        sections.append(("validation", job_config.validation))
    tokenizer = load_tokenizer(job_config.model)
    for name, section in sections:
        _check_data(section, name, tokenizer)
    check_converter_names(job_config.model.converters)
    check_checkpoint_inputs(job_config.checkpoint, job_config.job.dump_folder)
    check_fault_tolerance_inputs(job_config.fault_tolerance)
    _check_cuda_only(job_config.training, job_config.profiling, job_config.compile, device_type)
    _check_compile_backend(job_config.compile)


def _check_data(data: Any, section: str, tokenizer: BaseTokenizer | None) -> None:
    """The data set (or every source of a mixture) exists; a token store is complete and was
    made with this run's tokenizer."""
    if not uses_sources(data.dataset):
        sources = [(f"{section}", data.dataset, data.dataset_path)]
    else:
        sources = [
            (_source_field(section, data, i), c.dataset, c.dataset_path)
            for i, c in enumerate(source_configs(data))
        ]
    for field, dataset, path in sources:
        try:
            check_dataset_fields(dataset, path, field)
        except (ValueError, OSError) as e:
            raise ConfigError(str(e)) from None
        if dataset == TOKENS and tokenizer is not None:
            open_store(path, tokenizer, f"{field}.dataset_path")


def _source_field(section: str, data: Any, index: int) -> str:
    return f"{section}.dataset_mixture[{index}]" if data.dataset == MIXTURE else section


def _check_context_parallel(
    parallelism: ParallelismConfig,
    seq_lens: dict[str, int],
    parallel_dims: ParallelDims,
    n_heads: int,
) -> None:
    """Context parallel splitting each sequence (``seq_lens``: field name -> length) into
    whole chunks, and heads for Ulysses."""
    for field, seq_len in seq_lens.items():
        try:
            check_cp_config(
                seq_len,
                parallel_dims.cp,
                parallel_dims.tp,
                n_heads,
                parallelism.context_parallel_rotate_method,
                parallelism.context_parallel_load_balancer,
                field,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_validation(
    validation: ValidationConfig, training: TrainingConfig, parallel_dims: ParallelDims
) -> None:
    if validation.seq_len % parallel_dims.seq_len_divisor != 0:
        raise ConfigError(
            f"validation.seq_len ({validation.seq_len}) must be divisible by tp * 2 * cp = "
            f"{parallel_dims.seq_len_divisor}, as training.seq_len is"
        )
    if parallel_dims.pp_enabled and (validation.seq_len, validation.local_batch_size) != (
        training.seq_len,
        training.local_batch_size,
    ):
        # The pipeline stages exchange buffers shaped by the first training step.
        raise ConfigError(
            "validation under pipeline parallel reuses the training schedule: set "
            f"validation.seq_len = training.seq_len ({training.seq_len}) and "
            "validation.local_batch_size = training.local_batch_size "
            f"({training.local_batch_size}); "
            f"got {validation.seq_len} and {validation.local_batch_size}"
        )


@config_errors_exit
def main(argv: list[str]) -> int:
    """``--world-size N [--print-loss-rank] [--quiet] [config flags]``: run the checks for N
    processes; print the rank that shows the loss (run_train.sh's default LOG_RANK).
    ``--quiet``: errors only (run_train.sh, whose trainer repeats every warning)."""
    level = logger.level
    if "--quiet" in argv:
        logger.setLevel(logging.ERROR)
    try:
        return _check(argv)
    finally:
        logger.setLevel(level)


def _check(argv: list[str]) -> int:
    print_loss_rank = "--print-loss-rank" in argv
    argv = [a for a in argv if a not in ("--print-loss-rank", "--quiet")]
    at = argv.index("--world-size")
    value = argv[at + 1] if at + 1 < len(argv) else ""
    if not value.isdigit():
        raise ConfigError(f"--world-size: needs a process count, got {value!r}")
    world_size = int(value)
    config = ConfigManager().parse_args(argv[:at] + argv[at + 2 :])
    device_type = default_device_type()
    parallel_dims = preflight(config, world_size, device_type, local_gpu_capability(device_type))
    check_inputs(config, device_type)
    if print_loss_rank:
        print(loss_owner_rank(config.parallelism, parallel_dims))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
