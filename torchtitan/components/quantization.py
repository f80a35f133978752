"""Low-precision training through torchao, as model converters (``model.converters``):

* ``float8`` / ``quantize.linear.float8``: eligible ``nn.Linear``s become torchao
  ``Float8Linear``s (tensorwise, rowwise or rowwise_with_gw_hp scaling), optionally with
  float8 FSDP all-gather and the scales of all FSDP weights computed after the optimizer step;
* ``mx`` / ``quantize.linear.mx``: eligible ``nn.Linear`` weights run their matmuls in MXFP8;
* ``quantize.grouped_mm.float8`` / ``quantize.grouped_mm.mx``: the routed-expert weights of
  MoE layers run their grouped GEMMs in float8 rowwise / MXFP8 (CUDA only).

torchao is imported only when a converter is built. ``check_quantization`` is the preflight
part: hardware, model and layout checks that fail with one line before any process starts.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from torch import nn

from torchtitan.config import (
    ConfigError,
    Float8GroupedMMConfig,
    Float8LinearConfig,
    ModelConfig,
    MXGroupedMMConfig,
    MXLinearConfig,
    QuantizeConfig,
)
from torchtitan.distributed import ParallelDims
from torchtitan.layers.moe import GroupedExperts
from torchtitan.protocols.model_converter import register_model_converter
from torchtitan.tools.logging import logger

FLOAT8_LINEAR = ("float8", "quantize.linear.float8")
MX_LINEAR = ("mx", "quantize.linear.mx")
FLOAT8_GROUPED_MM = "quantize.grouped_mm.float8"
MX_GROUPED_MM = "quantize.grouped_mm.mx"
# The smallest CUDA compute capability with the needed kernels (float8 matmul: Ada/Hopper,
# float8 grouped GEMM: Hopper, MXFP8: Blackwell).
FLOAT8_SM, FLOAT8_GROUPED_SM, MX_SM = (8, 9), (9, 0), (10, 0)


def _import_torchao() -> None:
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ConfigError(
            "model.converters: the float8/mx converters need torchao; install it with "
            "pip install -e '.[dev]' (or pip install torchao --no-deps)"
        ) from None


# ---------------------------------------------------------------------------- linear selection
OUTPUT = "output"
"""The ``filter_fqns`` entry that also names the model's output layer under whatever FQN the
model gives it (the hf backend's ``lm_head``)."""


def output_fqn(model: nn.Module) -> str | None:
    """The FQN of the model's output layer (its ``output`` attribute), if it has one."""
    output = getattr(model, OUTPUT, None)
    if not isinstance(output, nn.Module):
        return None
    return next((name for name, module in model.named_modules() if module is output), None)


class LinearFilter:
    """Which ``nn.Linear``s a converter swaps: both dimensions divisible by 16 (the float8
    and MX matmul kernels need it) and no ``filter_fqns`` entry in the FQN (``"output"``
    also matches the model's output layer by identity). Remembers which entries matched, so
    a misspelt one can be reported."""

    def __init__(self, filter_fqns: list[str], model: nn.Module) -> None:
        self.filter_fqns = filter_fqns
        self.output_fqn = output_fqn(model)
        self.matched: set[str] = set()
        self.swapped: list[str] = []

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        is_output = fqn == self.output_fqn
        hits = {f for f in self.filter_fqns if f in fqn or (f == OUTPUT and is_output)}
        self.matched |= hits
        if hits or module.in_features % 16 or module.out_features % 16:
            return False
        self.swapped.append(fqn)
        return True

    def report(self, field: str, what: str, total: int) -> None:
        for unused in [f for f in self.filter_fqns if f not in self.matched]:
            logger.warning(
                f"{field}.filter_fqns: {unused!r} matches no nn.Linear; check the spelling"
            )
        if not self.swapped:
            raise ConfigError(
                f"{field}: no nn.Linear qualifies (both dims divisible by 16, not in "
                f"filter_fqns); remove the converter from model.converters"
            )
        logger.info(f"{what}: swapped {len(self.swapped)} of {total} nn.Linear modules")


def count_linears(model: nn.Module) -> int:
    return sum(isinstance(m, nn.Linear) for m in model.modules())


# ---------------------------------------------------------------------------- converters
class Float8LinearConverter:
    """Swaps eligible linears for torchao ``Float8Linear``s with the configured recipe."""

    def __init__(self, settings: Float8LinearConfig, parallel_dims: ParallelDims | None) -> None:
        _import_torchao()
        self.settings = settings
        fsdp = parallel_dims is not None and parallel_dims.fsdp_enabled
        self.fsdp_float8_all_gather = settings.enable_fsdp_float8_all_gather and fsdp
        self.precompute_scales = (
            self.fsdp_float8_all_gather and self.settings.precompute_float8_dynamic_scale_for_fsdp
        )

    def convert(self, model: nn.Module) -> None:
        from torchao.float8 import Float8LinearConfig as TorchaoFloat8LinearConfig
        from torchao.float8 import convert_to_float8_training

        config = replace(
            TorchaoFloat8LinearConfig.from_recipe_name(self.settings.recipe),
            emulate=self.settings.emulate,
            enable_fsdp_float8_all_gather=self.fsdp_float8_all_gather,
        )
        total = count_linears(model)
        selected = LinearFilter(self.settings.filter_fqns, model)
        convert_to_float8_training(model, config=config, module_filter_fn=selected)
        selected.report(
            "quantize.linear.float8",
            f"float8 {self.settings.recipe}{' (emulated)' if self.settings.emulate else ''}",
            total,
        )

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        """Float8 all-gather casts each weight shard with a scale from the whole weight's
        amax; computing them all at once after the step saves one all-reduce per weight."""
        if not self.precompute_scales:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)


def _mx_config(recipe_name: str, emulate: bool) -> Any:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization.quantize_.common import KernelPreference

    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(recipe_name))
    return replace(config, kernel_preference=KernelPreference.EMULATED) if emulate else config


class MXLinearConverter:
    """Eligible linears keep their class; their weights become torchao MXFP8 training
    tensors whose matmuls quantize both operands to MXFP8."""

    def __init__(self, settings: MXLinearConfig, parallel_dims: ParallelDims | None) -> None:
        _import_torchao()
        self.settings = settings

    def convert(self, model: nn.Module) -> None:
        from torchao.quantization import quantize_

        total = count_linears(model)
        selected = LinearFilter(self.settings.filter_fqns, model)
        quantize_(
            model, _mx_config(self.settings.recipe_name, self.settings.emulate), filter_fn=selected
        )
        selected.report("quantize.linear.mx", f"MXFP8 {self.settings.recipe_name}", total)

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        pass


class GroupedMMConverter:
    """Routed-expert weights (``GroupedExperts`` under an FQN containing one of
    ``quantize.grouped_mm.float8.fqns``) become torchao float8 training tensors whose grouped
    GEMMs run in float8 rowwise."""

    name = FLOAT8_GROUPED_MM

    def __init__(
        self,
        settings: Float8GroupedMMConfig | MXGroupedMMConfig,
        parallel_dims: ParallelDims | None,
    ) -> None:
        _import_torchao()
        self.settings = settings

    def op_config(self) -> Any:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig

        return Float8TrainingOpConfig()

    def convert(self, model: nn.Module) -> None:
        from torchao.quantization import quantize_

        fqns = self.settings.fqns
        converted: list[str] = []

        def selected(module: nn.Module, fqn: str) -> bool:
            if isinstance(module, GroupedExperts) and any(f in fqn for f in fqns):
                converted.append(fqn)
                return True
            return False

        quantize_(model, self.op_config(), filter_fn=selected)
        if not converted:
            raise ConfigError(
                f"{self.name}.fqns: {fqns} match no MoE experts module; use e.g. experts"
            )
        logger.info(f"{self.name}: converted {len(converted)} experts modules")

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        pass


class MXGroupedMMConverter(GroupedMMConverter):
    """The same for MXFP8 (``quantize.grouped_mm.mx``)."""

    name = MX_GROUPED_MM

    def op_config(self) -> Any:
        return _mx_config(self.settings.recipe_name, emulate=False)


for _name in FLOAT8_LINEAR:
    register_model_converter(Float8LinearConverter, _name, config_section="quantize.linear.float8")
for _name in MX_LINEAR:
    register_model_converter(MXLinearConverter, _name, config_section="quantize.linear.mx")
register_model_converter(GroupedMMConverter, FLOAT8_GROUPED_MM, config_section=FLOAT8_GROUPED_MM)
register_model_converter(MXGroupedMMConverter, MX_GROUPED_MM, config_section=MX_GROUPED_MM)


# ---------------------------------------------------------------------------- preflight
def check_quantization(
    model: ModelConfig,
    quantize: QuantizeConfig,
    parallel_dims: ParallelDims,
    model_args: Any,
    device_type: str,
    capability: tuple[int, int] | None,
) -> None:
    """Hardware, model and layout checks of the quantize converters named in
    ``model.converters`` (one line each); ``capability``: the GPU's, None where not known."""
    converters = model.converters
    linear = quantize.linear
    if any(name in converters for name in FLOAT8_LINEAR):
        _check_hardware(
            "quantize.linear.float8",
            "float8",
            linear.float8.emulate,
            device_type,
            capability,
            FLOAT8_SM,
        )
        if linear.float8.enable_fsdp_float8_all_gather and not parallel_dims.fsdp_enabled:
            raise ConfigError(
                "quantize.linear.float8.enable_fsdp_float8_all_gather: needs FSDP "
                "(parallelism.data_parallel_shard_degree > 1); turn one of them off"
            )
    if any(name in converters for name in MX_LINEAR):
        _check_hardware(
            "quantize.linear.mx", "MXFP8", linear.mx.emulate, device_type, capability, MX_SM
        )
    for name, sm in ((FLOAT8_GROUPED_MM, FLOAT8_GROUPED_SM), (MX_GROUPED_MM, MX_SM)):
        if name in converters:
            section = (
                quantize.grouped_mm.float8 if name == FLOAT8_GROUPED_MM else quantize.grouped_mm.mx
            )
            _check_grouped_mm(name, model, section.fqns, model_args, device_type, capability, sm)


def _check_hardware(
    field: str,
    what: str,
    emulate: bool,
    device_type: str,
    capability: tuple[int, int] | None,
    min_sm: tuple[int, int],
) -> None:
    if emulate:
        return
    sm = f"SM{min_sm[0]}{min_sm[1]}"
    if device_type != "cuda":
        raise ConfigError(
            f"{field}.emulate: {what} matmuls need a CUDA GPU of {sm}+; on "
            f"{device_type} set --{field}.emulate (testing only, no speed-up)"
        )
    if capability is not None and capability < min_sm:
        raise ConfigError(
            f"{field}.emulate: this GPU (SM{capability[0]}{capability[1]}) has no "
            f"{what} matmuls (needs {sm}+); set --{field}.emulate or drop the converter"
        )


def _check_grouped_mm(
    name: str,
    model: ModelConfig,
    fqns: list[str],
    model_args: Any,
    device_type: str,
    capability: tuple[int, int] | None,
    min_sm: tuple[int, int],
) -> None:
    if getattr(model_args, "moe", None) is None:
        raise ConfigError(
            f"model.converters: {name} needs a MoE model; {model.name} "
            f"{model.flavor} has no routed experts"
        )
    if not fqns:
        raise ConfigError(f"{name}.fqns: empty; name the expert modules to convert, e.g. experts")
    sm = f"SM{min_sm[0]}{min_sm[1]}"
    if device_type != "cuda" or (capability is not None and capability < min_sm):
        raise ConfigError(
            f"model.converters: {name} needs CUDA {sm}+ grouped GEMMs (torchao has "
            f"no emulation for them); this run has {device_type} "
            f"{'' if capability is None else f'SM{capability[0]}{capability[1]}'}".rstrip()
        )


# ---------------------------------------------------------------------------- tensor parallel
def float8_tensorwise_tp(model: nn.Module, device_type: str) -> bool:
    """Whether ``model``'s tensor-parallel plans take torchao's float8 styles (activations
    all-gathered in float8): on CUDA, when the float8 converter gave it tensorwise-scaled
    ``Float8Linear``s. Other recipes keep the plain styles, and so does gloo (CPU), which
    cannot all-gather float8 tensors. Read from the converted model itself; torchao is not
    imported for a model that no float8 converter touched."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    if device_type != "cuda" or float8_linear is None:
        return False
    from torchao.float8.config import ScalingGranularity

    return any(
        isinstance(m, float8_linear.Float8Linear)
        and m.config.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE
        for m in model.modules()
    )


def with_float8_styles(module: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` with the column/row-wise styles of Float8Linear targets replaced by torchao's
    float8 styles, and the input preparation of a module whose every direct linear is such
    a target by the float8 one (the input is cast once, before the all-gather; a module with
    a linear outside the plan, which would receive a float8 input, keeps the plain one)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    float8_targets = {
        path
        for path, style in plan.items()
        if type(style) in (ColwiseParallel, RowwiseParallel)
        and isinstance(module.get_submodule(path), Float8Linear)
    }
    out = dict(plan)
    for path in float8_targets:
        style = plan[path]
        float8_style = (
            Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
        )
        out[path] = float8_style(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    for path, style in plan.items():
        if type(style) is not PrepareModuleInput:
            continue
        linears = [
            f"{path}.{name}"
            for name, child in module.get_submodule(path).named_children()
            if isinstance(child, nn.Linear)
        ]
        if linears and all(n in float8_targets for n in linears):
            out[path] = PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                use_local_output=style.use_local_output,
            )
    return out
