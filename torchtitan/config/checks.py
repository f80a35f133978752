"""Range checks on a merged JobConfig (``check_job_config``), plus guards for features that
have not landed yet (a non-default value is refused, never accepted and silently ignored)."""

from __future__ import annotations

import importlib.util
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig

# (field, predicate that must hold, what the user should do)
_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("training.steps", lambda v: v >= 1, "must be >= 1"),
    ("training.local_batch_size", lambda v: v >= 1, "must be >= 1"),
    ("training.global_batch_size", lambda v: v == -1 or v >= 1, "must be -1 (auto) or >= 1"),
    ("training.seq_len", lambda v: v >= 1, "must be >= 1"),
    ("training.max_norm", lambda v: v > 0, "must be > 0"),
    ("training.gc_freq", lambda v: v >= 1, "must be >= 1"),
    ("training.data_shards", lambda v: v >= 1, "must be >= 1"),
    (
        "training.loss_chunk_size",
        lambda v: v >= -1,
        "must be -1 (auto), 0 (full logits) or the tokens per chunk",
    ),
    ("training.dataloader.num_workers", lambda v: v >= 0, "must be >= 0"),
    ("validation.dataloader.num_workers", lambda v: v >= 0, "must be >= 0"),
    ("optimizer.lr", lambda v: v > 0, "must be > 0"),
    ("optimizer.eps", lambda v: v > 0, "must be > 0"),
    ("optimizer.weight_decay", lambda v: v >= 0, "must be >= 0"),
    ("optimizer.beta1", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("optimizer.beta2", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("optimizer.muon.momentum", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("optimizer.muon.ns_steps", lambda v: 1 <= v < 100, "must be in [1, 100)"),
    ("optimizer.muon.ns_coefficients", lambda v: len(v) == 3, "must be 3 numbers (a, b, c)"),
    ("optimizer.muon.eps", lambda v: v > 0, "must be > 0"),
    ("optimizer.muon.adamw_lr", lambda v: v is None or v > 0, "must be > 0"),
    ("optimizer.muon.adamw_weight_decay", lambda v: v is None or v >= 0, "must be >= 0"),
    ("lr_scheduler.warmup_steps", lambda v: v >= 0, "must be >= 0"),
    ("lr_scheduler.decay_ratio", lambda v: v is None or 0 <= v <= 1, "must be in [0, 1]"),
    ("lr_scheduler.min_lr_factor", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    ("metrics.log_freq", lambda v: v >= 1, "must be >= 1"),
    ("profiling.profile_freq", lambda v: v >= 1, "must be >= 1"),
    ("profiling.profiler_active", lambda v: v >= 1, "must be >= 1"),
    ("profiling.profiler_warmup", lambda v: v >= 0, "must be >= 0"),
    (
        "lr_scheduler.total_steps",
        lambda v: v is None or v >= 1,
        "must be >= 1 (unset = training.steps)",
    ),
    ("parallelism.data_parallel_replicate_degree", lambda v: v >= 1, "must be >= 1"),
    (
        "parallelism.data_parallel_shard_degree",
        lambda v: v == -1 or v >= 1,
        "must be -1 (infer) or >= 1",
    ),
    ("parallelism.tensor_parallel_degree", lambda v: v >= 1, "must be >= 1"),
    ("parallelism.pipeline_parallel_degree", lambda v: v >= 1, "must be >= 1"),
    ("parallelism.context_parallel_degree", lambda v: v >= 1, "must be >= 1"),
    ("parallelism.expert_parallel_degree", lambda v: v >= 1, "must be >= 1"),
    ("parallelism.expert_tensor_parallel_degree", lambda v: v >= 1, "must be >= 1"),
    ("parallelism.pipeline_parallel_microbatch_size", lambda v: v >= 1, "must be >= 1"),
    ("checkpoint.interval", lambda v: v >= 1, "must be >= 1"),
    ("checkpoint.keep_latest_k", lambda v: v >= 0, "must be >= 0 (0 keeps all)"),
    ("checkpoint.max_failures_at_same_step", lambda v: v >= 1, "must be >= 1"),
    ("debug.fail_at_step", lambda v: v is None or v >= 1, "must be >= 1 (unset = never)"),
    ("debug.step_sleep_seconds", lambda v: v >= 0, "must be >= 0"),
    ("debug.hang_at_step", lambda v: v is None or v >= 1, "must be >= 1 (unset = never)"),
    ("debug.hang_seconds", lambda v: v > 0, "must be > 0"),
    ("debug.straggler_slowdown", lambda v: v > 0, "must be > 0"),
    ("debug.straggler_from_step", lambda v: v >= 2, "must be >= 2 (step 1 warms up)"),
    ("metrics.straggler_threshold_pct", lambda v: v > 0, "must be > 0"),
    ("metrics.straggler_log_steps", lambda v: v >= 1, "must be >= 1"),
    (
        "comm.hang_timeout_factor",
        lambda v: v == 0 or v > 1,
        "must be 0 (no hang watchdog) or above 1 (times the median step)",
    ),
    ("comm.hang_timeout_floor_seconds", lambda v: v > 0, "must be > 0"),
    ("validation.local_batch_size", lambda v: v >= 1, "must be >= 1"),
    ("validation.seq_len", lambda v: v >= 1, "must be >= 1"),
    ("validation.freq", lambda v: v >= 1, "must be >= 1"),
    ("validation.data_shards", lambda v: v >= 1, "must be >= 1"),
    ("validation.steps", lambda v: v == -1 or v >= 1, "must be -1 (whole split) or >= 1"),
    ("lora.rank", lambda v: v >= 1, "must be >= 1"),
    ("lora.alpha", lambda v: v > 0, "must be > 0"),
    ("lora.dropout", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("comm.init_timeout_seconds", lambda v: v >= 1, "must be >= 1"),
    ("comm.train_timeout_seconds", lambda v: v >= 1, "must be >= 1"),
    ("memory_estimation.world_size", lambda v: v is None or v >= 1, "must be >= 1"),
    ("memory_estimation.device_memory_gib", lambda v: v is None or v > 0, "must be > 0"),
    ("memory_estimation.reserved_margin", lambda v: v >= 0, "must be >= 0"),
    ("memory_estimation.nccl_allowance_gib", lambda v: v >= 0, "must be >= 0"),
    ("memory_estimation.gpus_per_node", lambda v: v >= 1, "must be >= 1"),
    ("memory_estimation.plan_traced_layouts", lambda v: v >= 0, "must be >= 0"),
]

# Features whose issue has not landed: (field, predicate for "in use", issue title).
# The issue that builds a feature removes its line here.
_NOT_YET_SUPPORTED: list[tuple[str, Callable[[Any], bool], str]] = [
    ("parallelism.enable_compiled_autograd", bool, "compiled autograd"),
    ("optimizer.early_step_in_backward", bool, "optimizer step in backward"),
    (
        "memory_estimation.enable",
        bool,
        "memory estimation inside the trainer (use scripts/estimate/estimation.py)",
    ),
]


# Upstream settings of features this code base does not have: accepted at upstream's default
# (so upstream TOMLs load), refused otherwise.
_UPSTREAM_ONLY: dict[str, str] = {
    "parallelism.module_fqns_per_model_part": (
        "pipeline stages by module lists (use pipeline_parallel_split_points)"
    ),
    "parallelism.pipeline_parallel_expert_parallel_overlap": "the DualPipeV EP/PP overlap",
    "parallelism.expert_parallel_comm_backend": "DeepEP dispatch",
    "checkpoint.initial_load_in_hf_quantized": "loading quantized Hugging Face checkpoints",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": (
        "forced matmul recompute by FQN"
    ),
    "activation_checkpoint.early_stop": "early-stopped recomputation",
    "activation_checkpoint.memory_budget": "memory-budget activation checkpointing",
    "activation_checkpoint.visualize_memory_budget_pareto": (
        "memory-budget activation checkpointing"
    ),
    "activation_checkpoint.determinism_check": "recomputation determinism checks",
    "activation_checkpoint.debug": "activation-checkpoint debug mode",
    "comm.mode": (
        "fake-backend dry runs (python -m torchtitan.preflight --world-size N checks a layout)"
    ),
    "quantize.linear.float8.force_recompute_fp8_weight_in_bwd": (
        "forced float8 weight recomputation"
    ),
    "quantize.linear.float8.moe_fqns_prototype": (
        "float8 MoE prototype (use quantize.grouped_mm.float8.fqns)"
    ),
    "quantize.linear.mx.use_fp8_dim1_cast_triton_kernel": "choice of MX cast kernel",
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": "choice of MX cast kernel",
}

# MX recipe names of the torchao upstream used, which torchao 0.18 no longer has, and the
# converter names that turn each MX setting on.
_LEGACY_MX_RECIPES = {"mxfp8", "mxfp8_cublas"}
_MX_RECIPE_CONVERTERS = {
    "quantize.linear.mx.recipe_name": ("mx", "quantize.linear.mx"),
    "quantize.grouped_mm.mx.recipe_name": ("quantize.grouped_mm.mx",),
}


def _check_legacy_mx_recipes(config: Any) -> None:
    for path, converters in _MX_RECIPE_CONVERTERS.items():
        recipe = get_field(config, path)
        if recipe in _LEGACY_MX_RECIPES and set(converters) & set(config.model.converters):
            raise ConfigError(
                f"{path}={recipe!r}: an older torchao's recipe; with torchao 0.18 use "
                "'mxfp8_rceil' or 'mxfp8_rceil_wgrad_with_hp'"
            )


def get_field(config: Any, path: str) -> Any:
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def check_job_config(config: Any) -> None:
    """Raise ConfigError (one line naming the field) for the first invalid value."""
    for path, ok, rule in _RULES:
        value = get_field(config, path)
        if not ok(value):
            raise ConfigError(f"{path}: {rule}, got {value!r}")
    for path, in_use, feature in _NOT_YET_SUPPORTED:
        value = get_field(config, path)
        if in_use(value):
            raise ConfigError(
                f"{path}={value!r}: {feature} is not supported yet in this version; "
                "leave it at its default"
            )
    _check_upstream_only(config)
    _check_dataloaders(config)
    if config.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "metrics.enable_wandb: the wandb package is not installed; "
            "pip install 'torchtitan[wandb]'"
        )
    _check_profiler_schedule(config.profiling)
    _check_training_dtype(config.training)
    _check_loss_kernel(config.training, config.parallelism)
    _check_muon(config.optimizer)
    ac_error = check_ac_config(
        config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option
    )
    if ac_error:
        raise ConfigError(ac_error)
    if config.parallelism.enable_async_tensor_parallel and not config.compile.enable:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel: needs compile.enable (inductor fuses "
            "the overlapped collectives)"
        )
    _check_checkpoint(config.checkpoint, config.lora)
    for section in ("training", "validation"):
        _check_data_sources(getattr(config, section), section)
    _check_fault_tolerance(config.fault_tolerance, config.parallelism)
    _check_quantize(config.model.converters, config.quantize)
    _check_attention(config.model, config.training)
    etp, tp = (
        config.parallelism.expert_tensor_parallel_degree,
        config.parallelism.tensor_parallel_degree,
    )
    if etp not in (1, tp):
        raise ConfigError(
            f"parallelism.expert_tensor_parallel_degree: must be 1 or tensor_parallel_degree "
            f"({tp}), got {etp}"
        )


def _check_dataloaders(config: Any) -> None:
    for section in ("training", "validation"):
        dl = get_field(config, section).dataloader
        for name in ("prefetch_factor", "persistent_workers"):
            if getattr(dl, name) not in (None, False) and dl.num_workers == 0:
                raise ConfigError(
                    f"{section}.dataloader.{name}: needs {section}.dataloader.num_workers > 0"
                )
        if dl.prefetch_factor is not None and dl.prefetch_factor < 1:
            raise ConfigError(
                f"{section}.dataloader.prefetch_factor: must be >= 1, got {dl.prefetch_factor!r}"
            )
    if config.validation.dataloader.num_workers:
        raise ConfigError(
            "validation.dataloader.num_workers: the finite validation loader reads in the "
            "training process; leave it at 0"
        )


_SEMI_SYNC_METHODS = (None, "diloco", "local_sgd")


def _check_fault_tolerance(ft: Any, parallelism: Any) -> None:
    if not ft.enable:
        return
    if ft.group_size < 1:
        raise ConfigError(
            "fault_tolerance.group_size: must be >= 1 with fault_tolerance.enable, "
            f"got {ft.group_size}"
        )
    if not 0 <= ft.replica_id < ft.group_size:
        raise ConfigError(
            "fault_tolerance.replica_id: must be in 0 .. group_size - 1 = "
            f"{ft.group_size - 1}, got {ft.replica_id}"
        )
    if not 1 <= ft.min_replica_size <= ft.group_size:
        raise ConfigError(
            f"fault_tolerance.min_replica_size: must be in 1 .. group_size = {ft.group_size}, "
            f"got {ft.min_replica_size}"
        )
    if ft.semi_sync_method not in _SEMI_SYNC_METHODS:
        raise ConfigError(
            "fault_tolerance.semi_sync_method: must be unset, 'diloco' or 'local_sgd', "
            f"got {ft.semi_sync_method!r}"
        )
    if ft.process_group_timeout_ms < 1:
        raise ConfigError(
            "fault_tolerance.process_group_timeout_ms: must be >= 1, "
            f"got {ft.process_group_timeout_ms}"
        )
    if ft.semi_sync_method is not None:
        if parallelism.pipeline_parallel_degree > 1:
            raise ConfigError(
                f"fault_tolerance.semi_sync_method={ft.semi_sync_method!r}: "
                "not with pipeline parallel (the outer optimizer steps one model part); "
                "set parallelism.pipeline_parallel_degree = 1"
            )
        if ft.sync_steps < 1:
            raise ConfigError(f"fault_tolerance.sync_steps: must be >= 1, got {ft.sync_steps}")
        if ft.semi_sync_method == "local_sgd":
            _refuse_diloco_only_settings(ft)
        if not 0 <= ft.fragment_sync_delay < ft.sync_steps:
            raise ConfigError(
                "fault_tolerance.fragment_sync_delay: must be in 0 .. sync_steps - 1, "
                f"got {ft.fragment_sync_delay}"
            )
        if not 0.0 <= ft.fragment_update_alpha <= 1.0:
            raise ConfigError(
                "fault_tolerance.fragment_update_alpha: must be in [0, 1], "
                f"got {ft.fragment_update_alpha}"
            )


# Settings only DiLoCo reads (LocalSGD averages the weights, with no outer optimizer or
# fragments), at the values that leave them off.
_DILOCO_ONLY = {"should_quantize": False, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0}


def _refuse_diloco_only_settings(ft: Any) -> None:
    for name, off in _DILOCO_ONLY.items():
        if getattr(ft, name) != off:
            raise ConfigError(
                f"fault_tolerance.{name}: only DiLoCo reads it, not semi_sync_method='local_sgd'; "
                f"leave it at {off} or use semi_sync_method='diloco'"
            )


def _check_upstream_only(config: Any) -> None:
    defaults = JobConfig()
    _check_legacy_mx_recipes(config)
    for path, feature in _UPSTREAM_ONLY.items():
        value, default = get_field(config, path), get_field(defaults, path)
        if value != default:
            raise ConfigError(
                f"{path}={value!r}: this version has no {feature}; remove the key or leave "
                f"it at {default!r}"
            )


def _check_profiler_schedule(profiling: Any) -> None:
    cycle = profiling.profiler_warmup + profiling.profiler_active
    if profiling.enable_profiling and cycle > profiling.profile_freq:
        raise ConfigError(
            f"profiling.profile_freq ({profiling.profile_freq}) must be >= profiler_warmup + "
            f"profiler_active ({cycle}); raise profile_freq or shorten the cycle"
        )


def _check_training_dtype(training: Any) -> None:
    """Full bf16 training keeps bf16 parameters: computing in another dtype makes no sense."""
    if training.dtype == "bfloat16" and training.mixed_precision_param != "bfloat16":
        raise ConfigError(
            f"training.mixed_precision_param={training.mixed_precision_param!r} with "
            "training.dtype='bfloat16': parameters are already bf16; set mixed_precision_param "
            "to bfloat16 or training.dtype to float32"
        )


def _check_loss_kernel(training: Any, parallelism: Any) -> None:
    if training.loss_kernel != "liger":
        return
    if training.loss_chunk_size == 0:
        raise ConfigError(
            "training.loss_kernel='liger': is a chunked loss; training.loss_chunk_size=0 asks "
            "for the full logits (set it to -1 or leave loss_kernel at 'native')"
        )
    if parallelism.tensor_parallel_degree > 1:
        raise ConfigError(
            "training.loss_kernel='liger': Liger Kernel's loss knows no vocabulary shards; "
            "use 'native' under tensor parallel"
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(
            "training.loss_kernel='liger': the liger-kernel package is not installed "
            "(pip install liger-kernel, CUDA only), or use 'native'"
        )


def _check_muon(optimizer: Any) -> None:
    if optimizer.name != "Muon":
        defaults = type(optimizer.muon)()
        for name in defaults.__dataclass_fields__:
            if getattr(optimizer.muon, name) != getattr(defaults, name):
                raise ConfigError(
                    f"optimizer.muon.{name}: a Muon setting, but optimizer.name is "
                    f"{optimizer.name!r}; set optimizer.name = 'Muon' or drop it"
                )
        return


def check_ac_config(mode: str, selective_option: str) -> str | None:
    """An error message for an invalid selective activation-checkpointing option, else None."""
    if mode != "selective" or selective_option == "op":
        return None
    if not selective_option.isdigit() or int(selective_option) < 1:
        return (
            f"activation_checkpoint.selective_ac_option: must be a positive integer N (every "
            f"N-th block) or 'op', got {selective_option!r}"
        )
    return None


_CHECKPOINT_STATES = ("model", "optimizer", "lr_scheduler", "dataloader", "rng", "train_state")


def _check_checkpoint(ckpt: Any, lora: Any) -> None:
    unknown = [n for n in ckpt.exclude_from_loading if n not in _CHECKPOINT_STATES]
    if unknown:
        raise ConfigError(
            f"checkpoint.exclude_from_loading: unknown state(s) {', '.join(unknown)}; choose "
            f"from {', '.join(_CHECKPOINT_STATES)}"
        )
    for name in ("initial_load_in_hf", "last_save_in_hf", "initial_load_path"):
        if getattr(ckpt, name) and not ckpt.enable:
            raise ConfigError(f"checkpoint.{name}: needs checkpoint.enable")
    if lora.peft_adapter_path and not ckpt.enable:
        raise ConfigError("lora.peft_adapter_path: needs checkpoint.enable")
    unknown = [
        n
        for n in ckpt.preemption_signals
        if not isinstance(getattr(signal, n, None), signal.Signals)
    ]
    if unknown:
        raise ConfigError(
            "checkpoint.preemption_signals: unknown signal(s) "
            f"{', '.join(map(repr, unknown))}; use names such as SIGTERM or SIGUSR1"
        )


_RANDOM_ACCESS = ("tokens", "mixture")


def _check_data_sources(data: Any, section: str) -> None:
    """A mixture and its sources, and a shuffle, which needs token stores."""
    mixture = data.dataset_mixture
    if (data.dataset == "mixture") != bool(mixture):
        raise ConfigError(
            f'{section}.dataset_mixture: a mixture is {section}.dataset = "mixture" with its '
            f"[[{section}.dataset_mixture]] sources; set both or neither"
        )
    names = []
    for index, source in enumerate(mixture):
        field = f"{section}.dataset_mixture[{index}]"
        if not source.weight > 0:
            raise ConfigError(f"{field}.weight: must be > 0, got {source.weight!r}")
        if source.max_epochs is not None and not source.max_epochs > 0:
            raise ConfigError(
                f"{field}.max_epochs: must be > 0 (unset = no cap), got {source.max_epochs!r}"
            )
        if source.dataset == "mixture":
            raise ConfigError(f"{field}.dataset: a source cannot be a mixture itself")
        names.append(
            source.name
            or (Path(source.dataset_path).name if source.dataset_path else source.dataset)
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(
            f"{section}.dataset_mixture: two sources are named {repeated[0]!r}; give each a "
            "distinct name"
        )
    if section == "training" and data.shuffle_window < 0:
        raise ConfigError(
            f"training.shuffle_window: must be >= 0 (0 = a whole pass), got {data.shuffle_window}"
        )
    if (
        section == "training"
        and data.shuffle_seed is not None
        and data.dataset not in _RANDOM_ACCESS
    ):
        raise ConfigError(
            f"training.shuffle_seed: shuffling reads sequences out of order, which needs a token "
            f"store; prepare {data.dataset!r} once (python scripts/data/prepare.py) and train with "
            "--training.dataset tokens"
        )


def _check_attention(model: Any, training: Any) -> None:
    """Masks other than plain causal need FlexAttention; a window must fit the sequence."""
    if model.attn_type == "sdpa" and model.attn_mask_type != "causal":
        raise ConfigError(
            f"model.attn_mask_type {model.attn_mask_type!r} needs model.attn_type 'flex' "
            "(SDPA only masks causally); set --model.attn_type flex"
        )
    window = model.sliding_window
    if window is not None:
        if model.attn_type != "flex":
            raise ConfigError(
                "model.sliding_window needs model.attn_type 'flex'; set --model.attn_type flex"
            )
        if not 1 <= window <= training.seq_len:
            raise ConfigError(
                "model.sliding_window: must be between 1 and training.seq_len "
                f"({training.seq_len}), got {window}"
            )
    if training.reset_position_ids_per_document and model.attn_mask_type != "block_causal":
        raise ConfigError(
            "training.reset_position_ids_per_document: needs model.attn_mask_type 'block_causal' "
            "(positions restart per document only when documents do not attend to each other)"
        )


_LINEAR_CONVERTERS = {
    "float8": "float8",
    "quantize.linear.float8": "float8",
    "mx": "mx",
    "quantize.linear.mx": "mx",
}


def _check_quantize(converters: list[str], quantize: Any) -> None:
    """One converter per nn.Linear; the float8 FSDP settings only with what they need. Checked
    only while a float8 converter is on (its settings may sit in a config unused)."""
    linear = [name for name in converters if name in _LINEAR_CONVERTERS]
    if len(linear) > 1:
        raise ConfigError(
            f"model.converters: {' and '.join(linear)} both convert nn.Linear modules; keep one"
        )
    if not linear or _LINEAR_CONVERTERS[linear[0]] != "float8":
        return
    float8 = quantize.linear.float8
    if float8.enable_fsdp_float8_all_gather and float8.recipe != "tensorwise":
        raise ConfigError(
            "quantize.linear.float8.enable_fsdp_float8_all_gather: needs "
            f"quantize.linear.float8.recipe_name 'tensorwise', got {float8.recipe!r}; "
            "turn one of them off"
        )
    if float8.precompute_float8_dynamic_scale_for_fsdp and not float8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp: needs "
            "quantize.linear.float8.enable_fsdp_float8_all_gather"
        )
