"""The lora converter: which linears get adapters, one-line refusals, the frozen base (no
gradients, no optimizer state, bitwise unchanged by training), step 0 equal to the base
model, the paper's A/B initialisation, and merged export weights."""

from __future__ import annotations

import pytest
import torch

from torchtitan.components.adapters.lora import LoRAConverter, select_targets
from torchtitan.components.adapters.lora_linear import merged_weight
from torchtitan.components.optimizers.builder import build_optimizers
from torchtitan.config import ConfigError, ConfigManager, LoRAConfig
from torchtitan.distributed.parallel_dims import parallel_dims_from_config
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.qwen3.flavors import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.protocols.model_converter import ModelConvertersContainer
from torchtitan.tools.compile import compile_blocks

TINY = llama3_flavors["debugmodel_tiny"]  # 4 layers
EMULATED_FLOAT8 = ["--model.converters", "float8", "--quantize.linear.float8.emulate"]


def llama(lora: LoRAConfig | None = None, device: str = "meta") -> Transformer:
    with torch.device("meta"):
        model = Transformer(TINY)
    if lora is not None:
        LoRAConverter(lora, None).convert(model)
    if device != "meta":
        model.to_empty(device=device)
        model.init_weights(seed=0)
    return model


@pytest.mark.parametrize(
    ("patterns", "expected"),
    [
        (["attention"], 16),
        (["mlp"], 12),
        (["output"], 1),
        (["attention", "mlp", "output"], 29),
        (["wq"], 4),
        (["layers.0.attention.*"], 4),
        (["layers.*.feed_forward.w2"], 4),
    ],
)
def test_presets_globs_and_names_select_linears(patterns, expected):
    assert len(select_targets(llama(), patterns)) == expected


@pytest.mark.parametrize(
    ("model", "pattern", "message"),
    [
        ("llama", "wz", "'wz' matches no linear layer"),
        ("llama", "tok_embeddings", "matches no linear layer"),
        ("qwen3_moe", "experts", "selects MoE routed experts"),
        ("qwen3_tied", "output", "selects output, whose weight is tied to the input embedding"),
    ],
)
def test_bad_targets_are_refused_in_one_line(model, pattern, message):
    if model == "llama":
        target = llama()
    else:
        flavor = "debugmodel_moe" if model == "qwen3_moe" else "0.6B"
        with torch.device("meta"):
            target = Qwen3Model(qwen3_flavors[flavor])
    with pytest.raises(ConfigError, match=message) as error:
        select_targets(target, [pattern])
    assert str(error.value).startswith("lora.target_modules:") and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lora.rank", "0"], "lora.rank: must be >= 1"),
        (["--lora.rank", "-2"], "lora.rank: must be >= 1"),
        (["--lora.alpha", "0"], "lora.alpha: must be > 0"),
        (["--lora.dropout", "1.0"], r"lora.dropout: must be in \[0, 1\)"),
        (["--lora.peft_adapter_path", "/x"], "lora.peft_adapter_path: needs checkpoint.enable"),
    ],
)
def test_bad_settings_name_the_field(args, message):
    with pytest.raises(ConfigError, match=message):
        ConfigManager().parse_args(args)


def test_only_adapters_train():
    model = llama(LoRAConfig(target_modules=["attention", "output"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
    assert len(trainable) == 2 * 17


def train_three_steps(model: torch.nn.Module, tokens: torch.Tensor, optimizer_args=()):
    """Three AdamW steps; the frozen base gets no gradient and stays bitwise as it was, every
    adapter gets a gradient. Returns the optimizers."""
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    config = ConfigManager().parse_args(list(optimizer_args))
    optimizers = build_optimizers([model], config.optimizer, None)
    for _ in range(3):
        optimizers.zero_grad()
        model(tokens).logsumexp(-1).mean().backward()
        optimizers.step()
    for name, param in model.named_parameters():
        if name in frozen:
            assert param.grad is None and torch.equal(param, frozen[name]), name
        else:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    return optimizers


def test_step_zero_is_the_base_model_and_training_leaves_the_base_untouched():
    base = llama(device="cpu")
    model = llama(LoRAConfig(rank=4, target_modules=["attention", "mlp", "output"]), "cpu")
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(base(tokens), model(tokens))  # B = 0: the adapters add nothing
    for name, param in model.named_parameters():
        if name.endswith("lora_b"):
            assert not param.any()
        elif name.endswith("lora_a"):
            assert param.abs().max() <= param.shape[1] ** -0.5 and param.std() > 0
    optimizers = train_three_steps(model, tokens, ["--optimizer.weight_decay", "0.1"])
    assert not torch.equal(base(tokens), model(tokens))  # the adapters did train
    state_keys = [k for k in optimizers.state_dict() if k.startswith("state.")]
    assert state_keys and all(".lora_" in k for k in state_keys)


def test_merged_weight_computes_the_adapted_layer():
    linear = torch.nn.Linear(12, 10, bias=False)
    model = torch.nn.Sequential(linear)
    LoRAConverter(LoRAConfig(rank=3, alpha=6.0, target_modules=["0"]), None).convert(model)
    with torch.no_grad():
        linear.lora_a.normal_()
        linear.lora_b.normal_()
    x = torch.randn(5, 12)
    merged = merged_weight(linear.weight, linear.lora_a, linear.lora_b, linear.lora_scaling)
    torch.testing.assert_close(model(x), x @ merged.T)
    torch.testing.assert_close(
        model(x), x @ linear.weight.T + 2.0 * (x @ linear.lora_a.T @ linear.lora_b.T)
    )


def float8_llama(lora: LoRAConfig | None) -> Transformer:
    """The tiny Llama 3 with emulated float8 base linears (the float8 converter runs first,
    as model.converters = ["float8", "lora"] orders it), adapters on attention + MLP."""
    config = ConfigManager().parse_args(EMULATED_FLOAT8)
    with torch.device("meta"):
        model = Transformer(TINY)
    ModelConvertersContainer(
        config, parallel_dims_from_config(config.parallelism, config.fault_tolerance, 1)
    ).convert(model)
    if lora is not None:
        LoRAConverter(lora, None).convert(model)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def test_adapters_on_float8_base_linears_train_and_leave_the_base_untouched():
    from torchao.float8.float8_linear import Float8Linear

    base = float8_llama(None)
    model = float8_llama(LoRAConfig(rank=4, target_modules=["attention", "mlp"]))
    adapted = [m for m in model.modules() if hasattr(m, "lora_a")]
    assert len(adapted) == 28 and all(isinstance(m, Float8Linear) for m in adapted)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(base(tokens), model(tokens))  # B = 0 on top of the same float8 matmuls
    train_three_steps(model, tokens)
    assert not torch.equal(base(tokens), model(tokens))


def test_compiled_blocks_with_adapters_give_the_eager_loss_and_gradients():
    """Per-block compile traces the adapters' forward hook into each block's graph."""
    lora = LoRAConfig(rank=4, target_modules=["attention", "mlp", "output"])
    eager, compiled = llama(lora, "cpu"), llama(lora, "cpu")
    with torch.no_grad():
        for a, b in zip(eager.parameters(), compiled.parameters()):
            if a.requires_grad:  # B non-zero: the adapters change the output
                a.normal_(std=0.1)
                b.copy_(a)
    compile_blocks(compiled.layers, backend="aot_eager")
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for model in (eager, compiled):
        model(tokens).logsumexp(-1).mean().backward()
    torch.testing.assert_close(compiled(tokens), eager(tokens), rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert compiled.layers["0"]._compiled_call_impl is not None
