"""Optimizer parameter groups: ``optimizer.weight_decay_exclude`` (trained without weight
decay) and ``optimizer.lr_multipliers`` (a factor on the learning rate). Our AdamW equals
``torch.optim.AdamW`` built by hand with the same groups (a reference that decays the norms,
or leaves one multiplier out, differs), Muon's matrices and AdamW part both honour them, the
LR schedule scales every group alike, the groups survive a state-dict round trip by FQN, and
bad patterns or factors are one-line errors."""

from __future__ import annotations

import fnmatch
import re

import pytest
import torch

from tests.unit_tests.optimizer_steps import (
    STEPS,
    largest_difference,
    ours,
    stepper,
    tiny_model,
    train,
)
from torchtitan.components.optimizers.builder import build_optimizers
from torchtitan.components.optimizers.lr_schedule import build_lr_schedulers
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.models.llama3.model import Transformer
from torchtitan.protocols import get_train_spec

EXCLUDE = ["*norm*", "tok_embeddings.*"]


def optimizer_config(*args: str, exclude: tuple[str, ...] = ()):
    flags = ["--optimizer.implementation", "for-loop", "--optimizer.weight_decay", "0.5"]
    patterns = ["--optimizer.weight_decay_exclude", *EXCLUDE, *exclude]
    return ConfigManager().parse_args([*flags, *patterns, *args]).optimizer


def by_hand(model: Transformer, args, exclude: list[str]):
    """torch.optim.AdamW over a decayed group and a weight-decay-0 group chosen by name."""

    def exempt(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in exclude)

    named = list(model.named_parameters())
    return adamw_steps(
        [
            {"params": [p for n, p in named if not exempt(n)]},
            {"params": [p for n, p in named if exempt(n)], "weight_decay": 0.0},
        ],
        args,
    )


def adamw_steps(groups: list[dict], args):
    """A step function of torch.optim.AdamW over ``groups`` with the config's settings."""
    optimizer = torch.optim.AdamW(
        groups,
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
        weight_decay=args.weight_decay,
        foreach=False,
    )
    return stepper(optimizer)


def test_equal_to_torch_adamw_with_the_same_two_groups():
    args = optimizer_config()
    expected = train(model := tiny_model(), by_hand(model, args, EXCLUDE))
    got = train(model := tiny_model(), ours(model, args)[0])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_the_default_equals_torch_adamw_without_decay_on_norms_and_embeddings():
    args = ConfigManager().parse_args(["--optimizer.implementation", "for-loop"]).optimizer
    assert args.weight_decay > 0
    expected = train(model := tiny_model(), by_hand(model, args, EXCLUDE))
    got = train(model := tiny_model(), ours(model, args)[0])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    decay_all = train(model := tiny_model(), by_hand(model, args, []))
    assert largest_difference(decay_all, got) > 1e-6


def test_the_default_exempts_the_norms_biases_and_embeddings_of_every_family():
    """gpt-oss has linear, expert and router biases; Qwen3.5 its delta rule's ``dt_bias``;
    Llama 3 no bias, which the default's patterns need not match."""
    config = ConfigManager().parse_args([]).optimizer
    for name in ("llama3", "qwen3", "deepseek_v3", "gpt_oss", "qwen3_5"):
        spec = get_train_spec(name)
        model = spec.model_cls(spec.model_args["debugmodel"])
        exempt = {
            n
            for g in build_optimizers([model], config, None).param_groups
            if g.get("weight_decay") == 0.0
            for n, p in model.named_parameters()
            if any(p is q for q in g["params"])
        }
        expected = {
            n
            for n, p in model.named_parameters()
            if n.endswith("norm.weight")
            or "bias" in n
            or n.startswith("tok_embeddings.")
            or re.fullmatch(r".*\.experts\.b\d", n)
        }
        assert exempt == expected, name
        assert any("bias" in n for n in exempt) == (name in ("gpt_oss", "qwen3_5")), name


def test_a_reference_that_decays_the_excluded_parameters_differs():
    args = optimizer_config()
    planted = train(model := tiny_model(), by_hand(model, args, EXCLUDE[:1]))
    got = train(model := tiny_model(), ours(model, args)[0])
    assert largest_difference(planted, got) > 1e-4


def test_the_groups_hold_the_matched_parameters_with_weight_decay_0():
    model = tiny_model()
    _, optimizers = ours(model, optimizer_config())
    decayed, exempt = optimizers.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.5 and exempt["weight_decay"] == 0.0
    assert {names[id(p)] for p in exempt["params"]} == {
        n for n in names.values() if "norm" in n or n.startswith("tok_embeddings.")
    }


def test_muon_honours_it_in_its_matrices_and_its_adamw_part():
    model = tiny_model()
    args = optimizer_config(
        "--optimizer.name",
        "Muon",
        "--optimizer.muon.ns_dtype",
        "float32",
        exclude=("layers.0.attention.wq.weight",),
    )
    _, optimizers = ours(model, args)
    wq = model.layers["0"].attention.wq.weight
    decay_of = {id(p): g["weight_decay"] for g in optimizers.param_groups for p in g["params"]}
    assert decay_of[id(wq)] == 0.0 and decay_of[id(model.layers["0"].attention.wk.weight)] > 0
    assert decay_of[id(model.norm.weight)] == 0.0
    assert decay_of[id(model.tok_embeddings.weight)] == 0.0


def test_the_groups_round_trip_through_the_state_dict_by_fqn():
    args = optimizer_config()
    train(model := tiny_model(), (ours_step := ours(model, args))[0])
    state = ours_step[1].state_dict()
    assert state["param_groups.norm.weight.weight_decay"] == 0.0
    assert state["param_groups.output.weight.weight_decay"] == 0.5
    fresh_step, fresh = ours(fresh_model := tiny_model(), args)
    fresh.load_state_dict(state)
    assert [g["weight_decay"] for g in fresh.param_groups] == [0.5, 0.0]
    assert largest_difference(train(model, ours_step[0]), train(fresh_model, fresh_step)) > 0


def test_a_resume_with_other_groups_keeps_the_configured_weight_decay():
    """The saved moments load; the weight decay of each group is the resumed run's."""
    decay_all = ConfigManager().parse_args(["--optimizer.weight_decay", "0.5"]).optimizer
    for saved, resumed in ((optimizer_config(), decay_all), (decay_all, optimizer_config())):
        step, optimizers = ours(model := tiny_model(), saved)
        train(model, step)
        _, fresh = ours(tiny_model(), resumed)
        configured = [g["weight_decay"] for g in fresh.param_groups]
        fresh.load_state_dict(optimizers.state_dict())
        assert [g["weight_decay"] for g in fresh.param_groups] == configured
        assert all(fresh.optimizers[0].state[p]["step"] == STEPS for p in fresh_params(fresh))


def fresh_params(optimizers) -> list[torch.nn.Parameter]:
    return [p for g in optimizers.param_groups for p in g["params"]]


MULTIPLIERS = ["--optimizer.lr_multipliers", "output.*", "2", "tok_embeddings.*", "0.5"]


def by_hand_with_multipliers(model: Transformer, args, output_factor: float = 2.0):
    """The four groups of EXCLUDE x MULTIPLIERS, listed by hand."""
    named = dict(model.named_parameters())
    norms = [p for n, p in named.items() if "norm" in n]
    matrices = [p for n, p in named.items() if "norm" not in n and n.startswith("layers.")]
    return adamw_steps(
        [
            {"params": matrices},
            {"params": [named["tok_embeddings.weight"]], "weight_decay": 0.0, "lr": args.lr / 2},
            {"params": norms, "weight_decay": 0.0},
            {"params": [named["output.weight"]], "lr": args.lr * output_factor},
        ],
        args,
    )


def test_equal_to_torch_adamw_with_the_same_lr_multipliers():
    args = optimizer_config(*MULTIPLIERS)
    expected = train(model := tiny_model(), by_hand_with_multipliers(model, args))
    got = train(model := tiny_model(), ours(model, args)[0])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    planted = train(model := tiny_model(), by_hand_with_multipliers(model, args, 1.0))
    assert largest_difference(planted, got) > 1e-4


def test_the_schedule_scales_every_group_alike():
    config = ConfigManager().parse_args(
        [*MULTIPLIERS, "--lr_scheduler.warmup_steps", "4", "--training.steps", "8"]
    )
    optimizers = build_optimizers([tiny_model()], config.optimizer, None)
    schedulers = build_lr_schedulers(optimizers, config.lr_scheduler, config.training.steps)
    for _ in range(3):
        optimizers.step()
        schedulers.step()
        base = schedulers.get_last_lr()
        assert optimizers.param_groups[0]["lr"] == base
        factors = sorted(g["lr"] / base for g in optimizers.param_groups)
        assert factors == pytest.approx([0.5, 1, 1, 2])  # the norms: the default's second group


def test_a_multiplier_of_0_is_refused_with_the_config():
    with pytest.raises(
        ConfigError, match=r"optimizer.lr_multipliers: 'output.\*' = 0.0 must be > 0"
    ):
        ConfigManager().parse_args(["--optimizer.lr_multipliers", "output.*", "0"])


def test_a_multiplier_pattern_that_matches_no_parameter_is_one_line():
    args = optimizer_config("--optimizer.lr_multipliers", "lm_head.*", "2")
    with pytest.raises(ConfigError, match=r"^optimizer.lr_multipliers: 'lm_head.\*' matches no"):
        build_optimizers([tiny_model()], args, None)


def test_a_pattern_that_matches_no_parameter_is_one_line():
    args = optimizer_config(exclude=("layers.*.attn_norm.weight",))
    with pytest.raises(ConfigError, match=r"^optimizer.weight_decay_exclude: 'layers.\*.attn"):
        build_optimizers([tiny_model()], args, None)


def test_an_empty_pattern_is_refused_with_the_config():
    with pytest.raises(ConfigError, match="optimizer.weight_decay_exclude: an empty pattern"):
        ConfigManager().parse_args(["--optimizer.weight_decay_exclude", " "])
