"""``optimizer.state_dtype = "bfloat16"``: Adam's and AdamW's moments stored in bf16. In fp32
the hand-written optimizer takes torch.optim's steps (1e-6 over 5 steps; Adam's L2 penalty in
place of AdamW's decoupled decay differs); in bf16 the moments are bf16 tensors, the
parameters stay within rounding of the fp32 run, the state dict round-trips, and Muon's
AdamW part follows the setting while its momentum stays fp32."""

from __future__ import annotations

import pytest
import torch

from tests.unit_tests.optimizer_steps import largest_difference, ours, stepper, tiny_model, train
from torchtitan.components.optimizers.adam_states import AdamWithStateDtype
from torchtitan.config import ConfigManager

SETTINGS = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_in_fp32_it_takes_torch_optims_steps(name):
    reference_cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[name]
    model = tiny_model()
    expected = train(model, stepper(reference_cls(model.parameters(), **SETTINGS, foreach=False)))
    model = tiny_model()
    ours_fp32 = AdamWithStateDtype(
        model.parameters(), **SETTINGS, decoupled=name == "AdamW", state_dtype=torch.float32
    )
    got = train(model, stepper(ours_fp32))
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_the_reference_tells_adams_penalty_from_adamws_decay():
    model = tiny_model()
    expected = train(model, stepper(torch.optim.AdamW(model.parameters(), **SETTINGS)))
    model = tiny_model()
    planted = AdamWithStateDtype(
        model.parameters(), **SETTINGS, decoupled=False, state_dtype=torch.float32
    )
    assert largest_difference(expected, train(model, stepper(planted))) > 1e-4


def config(*args: str):
    return ConfigManager().parse_args(["--optimizer.lr", "3e-3", *args]).optimizer


def test_bf16_moments_stay_within_rounding_of_fp32():
    fp32 = train(model := tiny_model(), ours(model, config())[0])
    step, optimizers = ours(model := tiny_model(), config("--optimizer.state_dtype", "bfloat16"))
    bf16 = train(model, step)
    states = [s for opt in optimizers for s in opt.state.values()]
    assert {s["exp_avg"].dtype for s in states} == {torch.bfloat16}
    assert {s["exp_avg_sq"].dtype for s in states} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert 0 < largest_difference(fp32, bf16) < 2e-3


def test_the_bf16_state_dict_round_trips():
    bf16 = config("--optimizer.state_dtype", "bfloat16")
    step, optimizers = ours(model := tiny_model(), bf16)
    train(model, step)
    state = optimizers.state_dict()
    moments = [v for k, v in state.items() if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}
    _, fresh = ours(tiny_model(), bf16)
    fresh.load_state_dict(state)
    assert torch.equal(
        fresh.state_dict()["state.output.weight.exp_avg"], state["state.output.weight.exp_avg"]
    )


def test_muons_adamw_part_follows_the_state_dtype():
    args = config(
        "--optimizer.name",
        "Muon",
        "--optimizer.muon.ns_dtype",
        "float32",
        "--optimizer.state_dtype",
        "bfloat16",
    )
    step, optimizers = ours(model := tiny_model(), args)
    train(model, step)
    muon, adamw = optimizers.optimizers
    assert {t.dtype for s in muon.state.values() for t in s.values() if t.ndim} == {torch.float32}
    assert {s["exp_avg"].dtype for s in adamw.state.values()} == {torch.bfloat16}
