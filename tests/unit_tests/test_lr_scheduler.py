import math

import pytest
import torch

from torchtitan.components.optimizers.builder import build_optimizers
from torchtitan.components.optimizers.lr_schedule import (
    build_lr_schedulers,
    lr_factor,
    schedule_lengths,
)
from torchtitan.config import ConfigManager


def factors(steps, warmup, decay_ratio, decay_type="linear", min_lr=0.0):
    w, d = schedule_lengths(steps, warmup, decay_ratio)
    return [
        lr_factor(
            i,
            warmup_steps=w,
            decay_steps=d,
            total_steps=steps,
            decay_type=decay_type,
            min_lr_factor=min_lr,
        )
        for i in range(steps)
    ]


def test_warmup_then_linear_decay_by_hand():
    # 10 steps, warmup 2, decay right after warmup (8 steps)
    expected = [1 / 3, 2 / 3] + [1 - k / 8 for k in range(8)]
    assert factors(10, 2, None) == pytest.approx(expected)


def test_warmup_stable_decay_with_min_lr():
    # 10 steps, warmup 2, decay over the last 4 (ratio 0.4), min 0.1
    got = factors(10, 2, 0.4, min_lr=0.1)
    stable = [1.0] * 4
    decay = [0.1 + 0.9 * (1 - k / 4) for k in range(4)]
    assert got == pytest.approx([1 / 3, 2 / 3] + stable + decay)


@pytest.mark.parametrize(
    "decay_type, shape",
    [
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_decay_shapes(decay_type, shape):
    got = factors(8, 0, 0.5, decay_type=decay_type)
    assert got == pytest.approx([1.0] * 4 + [shape(k / 4) for k in range(4)])


def test_warmup_longer_than_run_is_shortened():
    assert schedule_lengths(10, 20, 0.5) == (5, 5)


def test_schedulers_drive_optimizer_lr():
    config = ConfigManager().parse_args(
        [
            "--training.steps",
            "6",
            "--lr_scheduler.warmup_steps",
            "2",
            "--optimizer.lr",
            "1.0",
            "--optimizer.implementation",
            "for-loop",
        ]
    )
    model = torch.nn.Linear(2, 2)
    optimizers = build_optimizers([model], config.optimizer, None)
    schedulers = build_lr_schedulers(optimizers, config.lr_scheduler, config.training.steps)
    seen = []
    for _ in range(6):
        seen.append(optimizers.param_groups[0]["lr"])
        optimizers.step()
        schedulers.step()
    assert seen == pytest.approx(factors(6, 2, None))


def test_a_resumed_second_optimizer_keeps_its_own_lr():
    """Muon builds a Muon and an AdamW optimizer with different lrs; the saved scheduler
    state (the first one's) restores the step of both, not the first one's lr."""
    args = ["--training.steps", "6", "--lr_scheduler.warmup_steps", "2", "--optimizer.name"]
    args += ["Muon", "--optimizer.lr", "2e-2", "--optimizer.muon.adamw_lr", "1e-3"]
    args += ["--optimizer.muon.adamw_params", "1.*"]  # the LayerNorm
    args += ["--optimizer.muon.ns_dtype", "float32"]
    config = ConfigManager().parse_args(args)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        optimizers = build_optimizers([model], config.optimizer, None)
        schedulers = build_lr_schedulers(optimizers, config.lr_scheduler, config.training.steps)
        return optimizers, schedulers

    optimizers, schedulers = build()
    for _ in range(3):
        optimizers.step()
        schedulers.step()
    resumed_optimizers, resumed = build()
    resumed.load_state_dict(schedulers.state_dict())
    resumed.step()
    schedulers.step()
    lrs = [g["lr"] for g in optimizers.param_groups]
    assert lrs[0] / lrs[1] == pytest.approx(20.0)
    assert [g["lr"] for g in resumed_optimizers.param_groups] == pytest.approx(lrs)
