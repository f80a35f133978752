"""``activation_checkpoint.mode = "memory_budget"``: torch's min-cut partitioner keeps at most
``memory_budget`` of each compiled block's activations for backward. On two blocks of the
debug model the bytes saved for backward fall from budget 1 to 0.5 to 0 (eager keeps the
most), the loss and gradients equal eager's, and a budget outside [0, 1] or the mode without
compile is one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._functorch.config as functorch_config

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.tools.compile import compile_blocks

# the partitioner inductor uses, without generating C++ (fast on a CPU test machine)
BACKEND = "aot_eager_decomp_partition"


def saved_for_backward(budget: float | None) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """(bytes of the storages saved for backward, loss, gradients) of one step of the debug
    model; ``budget`` None: eager, without activation checkpointing."""
    torch._dynamo.reset()
    model = Transformer(dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2))
    model.init_weights(seed=0)
    if budget is not None:
        apply_ac(model.layers, "memory_budget", "2", memory_budget=budget)
        compile_blocks(model.layers, BACKEND)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, 2000, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
    loss = logits.logsumexp(-1).mean()
    loss.backward()
    return sum(saved.values()), loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.slow
def test_the_budget_sets_what_the_compiled_blocks_keep(monkeypatch):
    monkeypatch.setattr(functorch_config, "activation_memory_budget", 1.0)  # restored after
    eager_bytes, eager_loss, eager_grads = saved_for_backward(None)
    kept = {}
    for budget in (1.0, 0.5, 0.0):
        kept[budget], loss, grads = saved_for_backward(budget)
        torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
        for got, expected in zip(grads, eager_grads):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    print(f"saved for backward: eager {eager_bytes:,} B; budget 1, 0.5, 0: {kept}")
    assert eager_bytes >= kept[1.0] > kept[0.5] > kept[0.0]
    assert kept[0.0] < 0.6 * kept[1.0]


def test_a_budget_outside_0_1_is_one_line():
    with pytest.raises(ConfigError, match=r"^activation_checkpoint.memory_budget: must be in"):
        ConfigManager().parse_args(
            [
                "--activation_checkpoint.mode",
                "memory_budget",
                "--activation_checkpoint.memory_budget",
                "1.5",
                "--compile.enable",
            ]
        )


def test_the_mode_without_compile_is_one_line():
    with pytest.raises(ConfigError, match="needs|set compile.enable"):
        ConfigManager().parse_args(["--activation_checkpoint.mode", "memory_budget"])
