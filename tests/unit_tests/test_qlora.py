"""QLoRA (``lora.base_quantization = "nf4"``): the adapted linears' base weights become torchao
NF4 tensors that compute the dequantized weight plus the adapters, stay bitwise frozen through
training with optimizer state for adapters only, and every layout or shape NF4 cannot serve
is refused in one line naming the setting."""

from __future__ import annotations

import builtins
import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torchao.quantization import NF4Tensor, to_nf4

from torchtitan.components.adapters.lora import LoRAConverter
from torchtitan.components.adapters.lora_linear import merged_weight
from torchtitan.components.adapters.qlora import (
    NF4_BYTES_PER_VALUE,
    QUANTIZE_BYTES_PER_VALUE,
    QUANTIZE_SCRATCH_BYTES,
    PendingBase,
    own_storage,
)
from torchtitan.components.optimizers.builder import build_optimizers
from torchtitan.config import ConfigError, ConfigManager, LoRAConfig
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.preflight import preflight

DEBUG = llama3_flavors["debugmodel"]  # dim 256: every attention and MLP weight holds whole groups
QLORA = ["--model.converters", "lora", "--lora.base_quantization", "nf4"]
EMULATE = "--quantize.linear.float8.emulate"


def adapted_llama(targets: list[str]) -> Transformer:
    with torch.device("meta"):
        model = Transformer(DEBUG)
    LoRAConverter(LoRAConfig(rank=4, target_modules=targets), None).convert(model)
    return model


def materialized(model: Transformer) -> Transformer:
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def qlora_llama(targets: list[str], load=None) -> Transformer:
    """As the trainer makes it: the base weights left on meta, then filled block by block."""
    model = adapted_llama(targets)
    pending = PendingBase([model], torch.device("cpu"), seed=0)
    pending.materialize_except(model)
    model.init_weights(seed=0)
    assert model.layers["0"].attention.wq.weight.is_meta
    pending.fill(load)
    assert not pending.fqns
    return model


def test_nf4_base_computes_the_dequantized_weight_and_stays_frozen():
    plain = {
        n: p.detach()
        for n, p in materialized(adapted_llama(["attention", "mlp"])).named_parameters()
    }
    model = qlora_llama(["attention", "mlp"])
    wq = model.layers["0"].attention.wq
    assert isinstance(wq.weight, NF4Tensor) and not wq.weight.requires_grad
    expected = to_nf4(plain["layers.0.attention.wq.weight"])
    assert torch.equal(wq.weight.quantized_data, expected.quantized_data)
    assert type(model.output.weight) is torch.nn.Parameter  # not adapted: not quantized
    assert torch.equal(model.output.weight, plain["output.weight"])
    with torch.no_grad():
        wq.lora_b.normal_()
    x = torch.randn(3, DEBUG.dim)
    dequantized = wq.weight.to(torch.float32)
    adapters = (x @ wq.lora_a.T @ wq.lora_b.T) * wq.lora_scaling
    torch.testing.assert_close(wq(x), x @ dequantized.T + adapters)
    merged = merged_weight(wq.weight, wq.lora_a, wq.lora_b, wq.lora_scaling)  # the HF export
    torch.testing.assert_close(x @ merged.T, wq(x))
    error = (dequantized - plain["layers.0.attention.wq.weight"]).abs().max()
    assert 0 < error < 0.2 * plain["layers.0.attention.wq.weight"].abs().max()  # a 4-bit step

    inner = {
        name: {k: getattr(p, k).clone() for k in ("quantized_data", "quantized_scalers")}
        for name, p in model.named_parameters()
        if isinstance(p, NF4Tensor)
    }
    assert len(inner) == DEBUG.n_layers * 7
    optimizers = build_optimizers([model], ConfigManager().parse_args([]).optimizer, None)
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        optimizers.zero_grad()
        model(tokens).logsumexp(-1).mean().backward()
        optimizers.step()
    params = dict(model.named_parameters())
    for name, tensors in inner.items():
        assert params[name].grad is None
        for key, value in tensors.items():
            assert torch.equal(getattr(params[name], key), value), (name, key)
    state_keys = [k for k in optimizers.state_dict() if k.startswith("state.")]
    assert state_keys and all(".lora_" in k for k in state_keys)


def test_the_base_is_made_one_block_at_a_time_from_the_load():
    """What ``load`` is given is one block's weights, and no other base weight is in full
    precision meanwhile; the values it writes are the ones quantized."""
    values = {
        n: p.detach()
        for n, p in materialized(adapted_llama(["attention", "mlp"])).named_parameters()
    }
    model = adapted_llama(["attention", "mlp"])
    pending = PendingBase([model], torch.device("cpu"), seed=1)  # the load wins over the seed
    base = pending.fqns
    blocks = []

    def load(block: dict[str, torch.Tensor]) -> None:
        params = dict(model.named_parameters())
        live = [n for n in base if not params[n].is_meta and not isinstance(params[n], NF4Tensor)]
        assert sorted(live) == sorted(block)
        blocks.append(sorted(block))
        for fqn, tensor in block.items():
            tensor.copy_(values[fqn])

    pending.materialize_except(model)
    model.init_weights(seed=1)
    pending.fill(load)
    assert [b[0].split(".")[1] for b in blocks] == [str(i) for i in range(DEBUG.n_layers)]
    assert all(len(b) == 7 for b in blocks)
    for name, p in model.named_parameters():
        if isinstance(p, NF4Tensor):
            assert torch.equal(p.quantized_data, to_nf4(values[name]).quantized_data), name


def test_an_fsdp_row_shard_owns_its_bytes_and_keeps_the_whole_weights_values():
    """torchao's chunk of an NF4 tensor views the whole weight (every rank would keep all of
    it) and its clone re-quantizes: the shard is a copy with the whole weight's blocks."""
    whole = to_nf4(torch.randn(1024, 512), 64, 256)
    rows = torch.chunk(whole, 4, dim=0)[1]
    assert rows.quantized_data.untyped_storage().nbytes() == whole.quantized_data.numel()
    shard = own_storage(rows)
    for name in shard.__tensor_flatten__()[0]:
        inner = getattr(shard, name)
        assert inner.untyped_storage().nbytes() == inner.numel() * inner.element_size(), name
    assert torch.equal(shard.get_original_weight(), whole.get_original_weight()[256:512])


def test_nf4_bytes_per_value():
    weight = to_nf4(torch.randn(1024, 256))
    stored = sum(
        t.numel() * t.element_size()
        for t in (weight.quantized_data, weight.quantized_scalers, weight.quantization_factor)
    )
    assert stored == pytest.approx(weight.numel() * NF4_BYTES_PER_VALUE)


@pytest.mark.parametrize("shape", [(28672, 8192), (14336, 4096), (1024, 4096)])
def test_quantizing_one_weight_needs_what_the_estimator_assumes(shape):
    """The closed form's QLoRA start: what to_nf4 of an fp32 weight (70B's w1, 8B's, 8B's
    wk) holds at its peak, traced on fake tensors; the model may overstate it by 5 %, never
    understate it."""
    with FakeTensorMode():
        weight = torch.empty(*shape)
        tracker = MemTracker()
        tracker.track_external(weight)
        with tracker:
            to_nf4(weight, 64, 256)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    modelled = QUANTIZE_BYTES_PER_VALUE * weight.numel() + QUANTIZE_SCRATCH_BYTES
    assert peak <= modelled <= 1.05 * peak, (peak, modelled)


def check(args: list[str], world_size: int = 1, flavor: str = "debugmodel"):
    config = ConfigManager().parse_args(["--model.flavor", flavor, *QLORA, *args])
    return preflight(config, world_size, "cpu")


@pytest.mark.parametrize(
    ("args", "world_size", "message"),
    [
        (["--parallelism.tensor_parallel_degree", "2"], 2, "tensor_parallel_degree > 1"),
        (["--model.converters", "float8,lora", EMULATE], 1, "model.converters 'float8'"),
        (["--lora.no-save_adapters_only"], 1, "needs lora.save_adapters_only = true"),
        (["--lora.target_modules", "output"], 1, r"output.weight \(2000 x 256\)"),
        (["--lora.target_modules", "w2"], 8, r"8 FSDP shard\(s\).*w2.weight \(256 x 768\)"),
        (["--model.converters", "float8", EMULATE], 1, '"nf4" needs "lora" in model.converters'),
    ],
)
def test_what_nf4_cannot_do_is_refused_in_one_line(args, world_size, message):
    with pytest.raises(ConfigError, match=message) as error:
        check(args, world_size)
    assert str(error.value).startswith("lora.base_quantization:") and "\n" not in str(error.value)


def test_a_float8_swap_after_lora_is_refused():
    """float8 replaces nn.Linear modules: after lora it would drop the adapters (float8
    first adapts the float8 linears, checked by hand: FSDP 2 within float8's 3e-3)."""
    config = ConfigManager().parse_args(["--model.converters", "lora,float8", EMULATE])
    with pytest.raises(
        ConfigError, match=r"^model.converters: 'float8' after 'lora'.*\['float8', 'lora'\]$"
    ):
        preflight(config, 1, "cpu")
    preflight(ConfigManager().parse_args(["--model.converters", "float8,lora", EMULATE]), 1, "cpu")


def test_layouts_nf4_serves_pass_preflight():
    check(["--lora.target_modules", "attention,mlp"], 4)  # FSDP 4
    check(["--parallelism.data_parallel_replicate_degree", "2"], 4)  # HSDP 2 x 2
    check(["--parallelism.pipeline_parallel_degree", "2"], 2)


def test_tiny_weights_are_refused():
    with pytest.raises(ConfigError, match=r"groups of 16,384 values.*wq.weight \(64 x 64\)"):
        check([], flavor="debugmodel_tiny")


def test_nf4_without_torchao_names_the_setting(monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(builtins, "__import__", no_torchao)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torchao" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r'"nf4" needs torchao \(pip install'):
        check([])
