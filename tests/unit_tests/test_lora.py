"""The lora converter: which linears get adapters, one-line refusals, the frozen base (no
gradients, no optimizer state, bitwise unchanged by training), step 0 equal to the base
model, the paper's A/B initialisation, and merged export weights."""

from __future__ import annotations

import pytest
import torch

from torchtitan.components.lora import LoRAConverter, select_targets
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config import ConfigError, ConfigManager, LoRAConfig
from torchtitan.layers.lora import merged_weight
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.qwen3.flavors import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model

TINY = llama3_flavors["debugmodel_tiny"]  # 4 layers


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
    ],
)
def test_bad_targets_are_refused_in_one_line(model, pattern, message):
    if model == "llama":
        target = llama()
    else:
        with torch.device("meta"):
            target = Qwen3Model(qwen3_flavors["debugmodel_moe"])
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
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    config = ConfigManager().parse_args(["--optimizer.weight_decay", "0.1"])
    optimizers = build_optimizers([model], config.optimizer, None)
    for _ in range(3):
        optimizers.zero_grad()
        model(tokens).logsumexp(-1).mean().backward()
        optimizers.step()
    for name, param in model.named_parameters():
        if name in frozen:
            assert param.grad is None and torch.equal(param, frozen[name]), name
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
