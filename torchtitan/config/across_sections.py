"""The checks of a job config that read more than one section, run after every section has
checked its own fields (``check_job_config``). A check that reads one section only belongs on
that section, in job_config.py."""

from __future__ import annotations

import importlib.util
from typing import Any

from torchtitan.config.errors import ConfigError

# MX recipe names of the torchao upstream used, which torchao 0.18 no longer has, and the
# converter names that turn each MX section on.
_LEGACY_MX_RECIPES = {"mxfp8", "mxfp8_cublas"}
_MX_SECTION_CONVERTERS = {
    "linear": ("mx", "quantize.linear.mx"),
    "grouped_mm": ("quantize.grouped_mm.mx",),
}
_FLOAT8_LINEAR_CONVERTERS = ("float8", "quantize.linear.float8")


def check_across_sections(config: Any) -> None:
    """Raise ConfigError (one line naming the field) for the first invalid combination."""
    _check_legacy_mx_recipes(config.quantize, config.model.converters)
    _check_liger_loss(config.training, config.parallelism)
    if config.parallelism.enable_async_tensor_parallel and not config.compile.enable:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel: needs compile.enable (inductor fuses "
            "the overlapped collectives)"
        )
    _check_memory_budget(config.activation_checkpoint, config.compile)
    if config.lora.peft_adapter_path and not config.checkpoint.enable:
        raise ConfigError("lora.peft_adapter_path: needs checkpoint.enable")
    _check_semi_sync_layout(config.fault_tolerance, config.parallelism)
    _check_float8_fsdp(config.quantize.linear.float8, config.model.converters)
    _check_attention_span(config.model, config.training)


def _check_legacy_mx_recipes(quantize: Any, converters: list[str]) -> None:
    for section, turned_on_by in _MX_SECTION_CONVERTERS.items():
        recipe = getattr(quantize, section).mx.recipe_name
        if recipe in _LEGACY_MX_RECIPES and set(turned_on_by) & set(converters):
            raise ConfigError(
                f"quantize.{section}.mx.recipe_name={recipe!r}: an older torchao's recipe; with "
                "torchao 0.18 use 'mxfp8_rceil' or 'mxfp8_rceil_wgrad_with_hp'"
            )


def _check_liger_loss(training: Any, parallelism: Any) -> None:
    """Liger Kernel's loss under tensor parallel is refused first: that holds wherever
    liger-kernel is installed."""
    if training.loss_kernel != "liger":
        return
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


def _check_memory_budget(ac: Any, compile_config: Any) -> None:
    """The memory budget is the compiler's: without compiled blocks nothing would be
    recomputed."""
    if ac.mode == "memory_budget" and not (
        compile_config.enable and "model" in compile_config.components
    ):
        raise ConfigError(
            "activation_checkpoint.mode='memory_budget': torch.compile's partitioner chooses "
            "what to recompute; set compile.enable (with 'model' in compile.components) or "
            "use mode full or selective"
        )


def _check_semi_sync_layout(ft: Any, parallelism: Any) -> None:
    if ft.enable and ft.semi_sync_method is not None and parallelism.pipeline_parallel_degree > 1:
        raise ConfigError(
            f"fault_tolerance.semi_sync_method={ft.semi_sync_method!r}: "
            "not with pipeline parallel (the outer optimizer steps one model part); "
            "set parallelism.pipeline_parallel_degree = 1"
        )


def _check_float8_fsdp(float8: Any, converters: list[str]) -> None:
    """The float8 FSDP settings only with what they need, checked only while a float8
    converter is on (its settings may sit in a config unused)."""
    if not set(_FLOAT8_LINEAR_CONVERTERS) & set(converters):
        return
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


def _check_attention_span(model: Any, training: Any) -> None:
    """A sliding window fits the sequence; positions restart per document only when
    documents do not attend to each other."""
    window = model.sliding_window
    if window is not None and not 1 <= window <= training.seq_len:
        raise ConfigError(
            "model.sliding_window: must be between 1 and training.seq_len "
            f"({training.seq_len}), got {window}"
        )
    if training.reset_position_ids_per_document and model.attn_mask_type != "block_causal":
        raise ConfigError(
            "training.reset_position_ids_per_document: needs model.attn_mask_type 'block_causal' "
            "(positions restart per document only when documents do not attend to each other)"
        )
