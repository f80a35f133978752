import pytest
import torch

from torchtitan.components.optimizers.builder import build_optimizers
from torchtitan.config import ConfigManager


def step_once(name, implementation):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = ConfigManager().parse_args(
        [
            "--optimizer.name",
            name,
            "--optimizer.implementation",
            implementation,
            "--optimizer.weight_decay",
            "0.1",
        ]
    )
    optimizers = build_optimizers([model], config.optimizer, None)
    for _ in range(3):
        optimizers.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizers.step()
    return [p.detach().clone() for p in model.parameters()], optimizers


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_implementations_agree(name):
    reference, optimizers = step_once(name, "for-loop")
    assert type(optimizers.optimizers[0]).__name__ == name
    for implementation in ("foreach", "fused"):
        params, _ = step_once(name, implementation)
        for a, b in zip(reference, params):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_hyperparameters_reach_the_optimizer():
    _, optimizers = step_once("AdamW", "foreach")
    group = optimizers.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["weight_decay"] == 0.1 and group["eps"] == 1e-8


def test_state_dict_is_keyed_by_fqn_and_round_trips():
    _, optimizers = step_once("AdamW", "foreach")
    state = optimizers.state_dict()
    assert any(key.startswith("state.0.weight") for key in state)
    optimizers.load_state_dict(state)
