"""The float8 / MX converters (torchao): which linears they swap, and the one-line refusals
of bad input (config, hardware, model)."""

import logging

import pytest
import torch
from torch import nn

from torchtitan.components.quantization import LinearFilter
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.distributed.parallel_dims import parallel_dims_from_config
from torchtitan.preflight import preflight
from torchtitan.protocols import get_train_spec
from torchtitan.protocols.model_converter import ModelConvertersContainer

torchao = pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

EMULATED_FLOAT8 = ["--model.converters", "float8", "--quantize.linear.float8.emulate"]
# The tiny Llama 3 has 4 blocks of 7 linears (all dims divisible by 16) and an output
# layer of 264 (the byte vocabulary), which is not.
TINY = ["--model.flavor", "debugmodel_tiny"]
BLOCK_LINEARS = 4 * 7


def convert(args: list[str]) -> nn.Module:
    config = ConfigManager().parse_args(TINY + args)
    spec = get_train_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.flavor_args("debugmodel_tiny"))
    ModelConvertersContainer(
        config, parallel_dims_from_config(config.parallelism, config.fault_tolerance, 1)
    ).convert(model)
    return model


def float8_linears(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def test_float8_swaps_every_eligible_linear():
    swapped = float8_linears(convert(EMULATED_FLOAT8))
    assert len(swapped) == BLOCK_LINEARS
    assert "output" not in swapped  # 264 is not divisible by 16


def test_filter_fqns_keep_linears_in_high_precision():
    swapped = float8_linears(
        convert(EMULATED_FLOAT8 + ["--quantize.linear.float8.filter_fqns", "feed_forward"])
    )
    assert len(swapped) == 4 * 4 and not any("feed_forward" in n for n in swapped)


def test_filter_fqn_matching_nothing_warns(caplog):
    with caplog.at_level(logging.WARNING):
        convert(EMULATED_FLOAT8 + ["--quantize.linear.float8.filter_fqns", "attention,feedforward"])
    warnings = [r.getMessage() for r in caplog.records if "matches no nn.Linear" in r.getMessage()]
    assert warnings == [
        "quantize.linear.float8.filter_fqns: 'feedforward' matches no nn.Linear; check the spelling"
    ]


def test_converter_that_swaps_nothing_is_an_error():
    with pytest.raises(ConfigError, match="quantize.linear.float8: no nn.Linear qualifies"):
        convert(EMULATED_FLOAT8 + ["--quantize.linear.float8.filter_fqns", "layers"])


def test_linear_filter_checks_both_dims():
    keep = LinearFilter([], nn.Module())
    assert keep(nn.Linear(32, 48, device="meta"), "a")
    assert not keep(nn.Linear(32, 40, device="meta"), "b")
    assert not keep(nn.Linear(40, 32, device="meta"), "c")
    assert keep.swapped == ["a"]


def test_output_in_filter_fqns_keeps_an_output_layer_of_another_name():
    """The hf backend's output layer is ``lm_head``: the filter entry ``output`` (upstream's
    habitual one) names it by identity, and is not reported as matching nothing."""
    model = nn.Module()
    model.lm_head = nn.Linear(32, 64, device="meta")
    model.output = model.lm_head
    model.block = nn.Linear(32, 32, device="meta")
    keep = LinearFilter(["output"], model)
    assert [fqn for fqn in ("block", "lm_head") if keep(getattr(model, fqn), fqn)] == ["block"]
    assert keep.matched == {"output"}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_emulated_float8_recipes_train_on_cpu(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.randn(8, 32)
    expected = model(x).detach()
    config = ConfigManager().parse_args(
        EMULATED_FLOAT8 + ["--quantize.linear.float8.recipe_name", recipe]
    )
    ModelConvertersContainer(
        config, parallel_dims_from_config(config.parallelism, config.fault_tolerance, 1)
    ).convert(model)
    assert len(float8_linears(model)) == 2
    out = model(x)
    out.sum().backward()
    assert model[0].weight.grad is not None
    # float8 e4m3 rounds each operand by up to 2^-4 relative; the products average it out
    assert torch.allclose(out, expected, rtol=0.1, atol=0.1)
    assert not torch.equal(out, expected)


def test_mx_linear_converts_weights():
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

    model = convert(["--model.converters", "mx", "--quantize.linear.mx.emulate"])
    converted = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and isinstance(m.weight.data, MXFP8TrainingWeightWrapperTensor)
    ]
    assert len(converted) == BLOCK_LINEARS


def check(
    args: list[str],
    device_type: str = "cpu",
    world_size: int = 1,
    capability: tuple[int, int] | None = None,
):
    return preflight(ConfigManager().parse_args(TINY + args), world_size, device_type, capability)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model.converters", "float8"],
            r"^quantize.linear.float8.emulate: float8 matmuls need a CUDA GPU of SM89\+; "
            r"on cpu set ",
        ),
        (
            ["--model.converters", "mx"],
            r"^quantize.linear.mx.emulate: MXFP8 matmuls need a CUDA GPU of SM100\+",
        ),
        (
            [
                "--model.converters",
                "quantize.grouped_mm.float8",
                "--quantize.grouped_mm.float8.fqns",
                "experts",
            ],
            r"^model.converters: quantize.grouped_mm.float8 needs a MoE model; "
            r"llama3 debugmodel_tiny has no",
        ),
        (
            EMULATED_FLOAT8 + ["--quantize.linear.float8.enable_fsdp_float8_all_gather"],
            r"^quantize.linear.float8.enable_fsdp_float8_all_gather: needs FSDP",
        ),
    ],
)
def test_bad_quantize_setups_give_one_line(args, message):
    with pytest.raises(ConfigError, match=message):
        check(args)


def test_float8_on_a_gpu_below_sm89_needs_emulate():
    with pytest.raises(
        ConfigError,
        match=r"^quantize.linear.float8.emulate: this GPU \(SM80\) has no "
        r"float8 matmuls \(needs SM89\+\); set --quantize.linear.float8.emulate",
    ):
        check(["--model.converters", "float8"], device_type="cuda", capability=(8, 0))
    check(EMULATED_FLOAT8, device_type="cuda", capability=(8, 0))


def test_grouped_mm_on_cpu_is_refused():
    moe = [
        "--model.name",
        "qwen3",
        "--model.flavor",
        "debugmodel_moe",
        "--model.converters",
        "quantize.grouped_mm.float8",
        "--quantize.grouped_mm.float8.fqns",
        "experts",
    ]
    with pytest.raises(
        ConfigError, match=r"needs CUDA SM90\+ grouped GEMMs \(torchao has no emulation"
    ):
        preflight(ConfigManager().parse_args(moe), 1, "cpu")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model.converters", "float8,mx"],
            r"^model.converters: float8 and mx both convert nn.Linear",
        ),
        (
            EMULATED_FLOAT8
            + [
                "--quantize.linear.float8.recipe_name",
                "rowwise",
                "--quantize.linear.float8.enable_fsdp_float8_all_gather",
            ],
            r"enable_fsdp_float8_all_gather: needs quantize.linear.float8.recipe_name "
            r"'tensorwise', got 'rowwise'",
        ),
        (
            EMULATED_FLOAT8 + ["--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"],
            r"precompute_float8_dynamic_scale_for_fsdp: "
            r"needs quantize.linear.float8.enable_fsdp_float8_all_gather",
        ),
    ],
)
def test_refused_combinations_name_both_settings(args, message):
    with pytest.raises(ConfigError, match=message):
        ConfigManager().parse_args(args)


def test_float8_settings_are_accepted_while_float8_is_off():
    ConfigManager().parse_args(
        ["--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
    )


def test_2025_float8_section_is_an_alias(tmp_path, caplog):
    toml = tmp_path / "old.toml"
    toml.write_text(
        '[model]\nconverters = ["float8"]\n[float8]\nemulate = true\nrecipe_name = "rowwise"\n'
    )
    with caplog.at_level(logging.WARNING):
        config = ConfigManager().parse_args(
            ["--job.config_file", str(toml), "--float8.filter_fqns", "output"]
        )
    float8 = config.quantize.linear.float8
    assert (float8.emulate, float8.recipe_name, float8.filter_fqns) == (True, "rowwise", ["output"])
    assert "'float8.*' is deprecated; use 'quantize.linear.float8.*'" in caplog.text


def test_tensorwise_tp_plan_takes_torchao_float8_styles():
    """Used on CUDA only (gloo cannot all-gather float8), so checked here on the plan."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from torchtitan.components.quantization import with_float8_styles
    from torchtitan.models.common.parallelize import gqa_block_tp_plan, root_tp_plan

    model = convert(EMULATED_FLOAT8)
    block = model.layers["0"]
    plan = with_float8_styles(block, gqa_block_tp_plan(block))
    styles = {path: type(style) for path, style in plan.items()}
    assert {p for p, s in styles.items() if s is Float8ColwiseParallel} == {
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "feed_forward.w1",
        "feed_forward.w3",
    }
    assert {p for p, s in styles.items() if s is Float8RowwiseParallel} == {
        "attention.wo",
        "feed_forward.w2",
    }
    assert (
        styles["attention"] is PrepareFloat8ModuleInput
        and styles["feed_forward"] is PrepareFloat8ModuleInput
    )
    assert (
        plan["attention.wo"].output_layouts
        == gqa_block_tp_plan(block)["attention.wo"].output_layouts
    )
    root = with_float8_styles(model, root_tp_plan(loss_parallel=True))
    assert type(root["output"]).__name__ == "ColwiseParallel"  # output stays nn.Linear


def test_memory_estimator_covers_float8_linears_for_the_target():
    """float8 linears are traced; the trainer's hardware check judges the target, not this
    host: a CUDA target (of unknown kind) passes without emulation, a CPU target needs it.
    MX and the grouped-GEMM converters are not covered."""
    from torchtitan.estimate.build import TrainingBuild
    from torchtitan.estimate.coverage import check_covered

    def covered(args: list[str]):
        config = ConfigManager().parse_args(args)
        return check_covered(TrainingBuild(config, 1, config.memory_estimation.target_device))

    float8 = TINY + ["--model.converters", "float8"]
    covered(float8)
    with pytest.raises(ConfigError, match=r"^quantize.linear.float8.emulate: float8 matmuls"):
        covered(float8 + ["--memory_estimation.target_device", "cpu"])
    mx = TINY + ["--model.converters", "mx"]
    with pytest.raises(
        ConfigError,
        match=r"^model.converters=\['mx'\]: MX training and float8 / MX grouped GEMMs .* is "
        r"not covered",
    ):
        covered(mx)
