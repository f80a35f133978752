"""One process, a tiny Llama 3 and a few optimizer steps: the harness the optimizer tests
(Muon, weight decay groups) compare against torch.optim built by hand."""

from __future__ import annotations

import torch

from torchtitan.components.optimizers.builder import build_optimizers
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer

STEPS = 5


def tiny_model() -> Transformer:
    model = Transformer(llama3_flavors["debugmodel_tiny"])
    model.init_weights(seed=0)
    return model


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 264, (2, 16), generator=g) for _ in range(STEPS + 1)]


def train(model: Transformer, step) -> list[torch.Tensor]:
    for tokens in batches()[:STEPS]:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        step()
    return [p.detach().clone() for p in model.parameters()]


def ours(model: Transformer, args):
    optimizers = build_optimizers([model], args, None)

    def step():
        optimizers.step()
        optimizers.zero_grad()

    return step, optimizers


def stepper(optimizer: torch.optim.Optimizer):
    """A step function: the optimizer's step, then its zero_grad."""

    def step():
        optimizer.step()
        optimizer.zero_grad()

    return step


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))
