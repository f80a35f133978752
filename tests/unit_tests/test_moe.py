"""The MoE layer: expert kernels, routing, token counting under activation checkpointing,
the aux-loss-free bias update, load metrics and the sequence-wise aux loss."""

import pytest
import torch
from torch import nn

from torchtitan.components.optimizers.builder import build_moe_optimizers
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.layers.moe import (
    GroupedExperts,
    MoE,
    MoEArgs,
    TokenChoiceTopKRouter,
    grouped_mm_works,
    moe_layers,
    moe_load_metrics,
    update_expert_biases,
)
from torchtitan.protocols import get_train_spec

DIM, HIDDEN = 16, 8


def _filled_experts(num_experts: int, use_grouped_mm: bool) -> GroupedExperts:
    experts = GroupedExperts(DIM, HIDDEN, num_experts, use_grouped_mm)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in experts.parameters():
            w.copy_(torch.randn(w.shape, generator=gen) / DIM**0.5)
    return experts


def test_grouped_mm_and_per_expert_matmuls_agree_with_empty_experts():
    assert grouped_mm_works(torch.device("cpu"), torch.float32, DIM, HIDDEN)
    counts = torch.tensor([5, 0, 3, 0, 9, 1])
    x = torch.randn(int(counts.sum()), DIM)
    out, grads = [], []
    for grouped in (True, False):
        experts = _filled_experts(len(counts), grouped)
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        out.append(y)
        grads.append([xi.grad] + [w.grad for w in experts.parameters()])
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _router(**kwargs) -> TokenChoiceTopKRouter:
    router = TokenChoiceTopKRouter(DIM, MoEArgs(**{"num_experts": 8, "top_k": 2, **kwargs}))
    nn.init.normal_(router.gate.weight, generator=torch.Generator().manual_seed(1))
    return router


def test_expert_bias_steers_choice_but_not_gating_weights():
    router, x = _router(score_func="sigmoid"), torch.randn(32, DIM)
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 always chosen
    weights, chosen, scores = router(x, bias, seq_len=32)
    assert (chosen == 5).any(dim=1).all()
    torch.testing.assert_close(weights, scores.gather(1, chosen))


def test_group_limited_routing_picks_from_the_best_groups_only():
    router, x = (
        _router(score_func="sigmoid", num_expert_groups=4, num_limited_groups=1),
        torch.randn(32, DIM),
    )
    _, chosen, scores = router(x, None, seq_len=32)
    group_scores = scores.view(32, 4, 2).sum(-1)  # top-2 of a 2-expert group = both
    assert (chosen // 2 == group_scores.argmax(-1, keepdim=True)).all()


def test_route_norm_and_scale():
    weights, _, _ = _router(route_norm=True, route_scale=2.5)(torch.randn(8, DIM), None, seq_len=8)
    torch.testing.assert_close(weights.sum(-1), torch.full((8,), 2.5))


def test_forced_load_balance_is_round_robin_by_position():
    _, chosen, _ = _router(top_k=3, force_load_balance=True)(
        torch.randn(2 * 8, DIM), None, seq_len=8
    )
    assert chosen.view(2, 8, 3)[0].tolist() == chosen.view(2, 8, 3)[1].tolist()
    assert torch.bincount(chosen.flatten(), minlength=8).tolist() == [6] * 8


def _debug_model() -> nn.Module:
    spec = get_train_spec("deepseek_v3")
    model = spec.model_cls(spec.flavor_args("debugmodel"))
    model.init_weights(seed=0)
    return model


@pytest.mark.parametrize("ac_mode", ["none", "full"])
def test_tokens_counted_once_per_forward_even_with_recompute(ac_mode):
    model = _debug_model()
    apply_ac(model.layers, ac_mode, "1")
    tokens = torch.randint(0, 264, (2, 16))
    model(tokens).sum().backward()  # full AC re-runs every block's forward in backward
    top_k = model.model_args.moe.top_k
    moes = moe_layers([model])
    assert len(moes) == 3
    for moe in moes.values():
        assert moe.tokens_per_expert.sum().item() == 2 * 16 * top_k
    model.eval()
    with torch.no_grad():
        model(tokens)  # evaluation does not count
    assert all(m.tokens_per_expert.sum().item() == 2 * 16 * top_k for m in moes.values())


def _in_layer(moe: MoE, layer: str) -> nn.Module:
    return nn.ModuleDict({"layers": nn.ModuleDict({layer: nn.ModuleDict({"moe": moe})})})


def test_bias_update_moves_towards_balance_and_resets_counts():
    moe = MoE(DIM, HIDDEN, MoEArgs(num_experts=4, top_k=1, load_balance_coeff=0.1))
    moe.tokens_per_expert.copy_(torch.tensor([8.0, 2.0, 5.0, 5.0]))
    update_expert_biases([moe], dp_cp_group=None)
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert moe.tokens_per_expert.sum() == 0
    assert moe_load_metrics([_in_layer(moe, "7")]) == {"moe/layer7_imbalance": pytest.approx(1.6)}


def test_moe_optimizer_updates_biases_before_each_step():
    from tests.layouts import single_process_dims
    from torchtitan.config import ConfigManager

    model = _debug_model()
    model(torch.randint(0, 264, (2, 16))).sum().backward()
    config = ConfigManager().parse_args(
        ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
    )
    dims = single_process_dims()
    optimizers = build_moe_optimizers([model], config.optimizer, dims)
    optimizers.step()
    for moe in moe_layers([model]).values():
        assert moe.tokens_per_expert.sum() == 0 and moe.expert_bias.abs().sum() > 0
    assert set(moe_load_metrics([model])) == {f"moe/layer{i}_imbalance" for i in (1, 2, 3)}


def test_aux_loss_gradient_reaches_the_router():
    args = MoEArgs(num_experts=4, top_k=2, score_func="sigmoid", aux_loss_alpha=0.01)
    moe = MoE(DIM, HIDDEN, args)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 8, DIM)
    moe(x).sum().backward()
    with_aux = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    tokens = x.view(-1, DIM)
    weights, chosen, scores = moe.router(tokens, moe.expert_bias, 8)
    expected_aux = moe._sequence_balance_loss(scores, chosen, 2, 8)
    moe.args = MoEArgs(**{**args.__dict__, "aux_loss_alpha": 0.0})
    (moe(x).sum() + expected_aux).backward()
    torch.testing.assert_close(moe.router.gate.weight.grad, with_aux)


def test_bias_updates_balance_a_frozen_router():
    """Tokens sharing a common direction overload some experts at first; the bias updates
    alone (router frozen) bring max/mean load close to 1."""
    args = MoEArgs(
        num_experts=8,
        top_k=3,
        score_func="sigmoid",
        route_norm=True,
        num_expert_groups=4,
        num_limited_groups=2,
        load_balance_coeff=1e-3,
    )
    gen = torch.Generator().manual_seed(0)
    moe = MoE(DIM, HIDDEN, args)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.02, generator=gen)
    moe.reset_buffers()
    common = torch.randn(DIM, generator=gen)
    imbalance = []
    for _ in range(40):
        x = torch.nn.functional.rms_norm(torch.randn(8, 128, DIM, generator=gen) + common, (DIM,))
        with torch.no_grad():
            moe(x)
        update_expert_biases([moe], dp_cp_group=None)
        imbalance.append(moe_load_metrics([_in_layer(moe, "1")])["moe/layer1_imbalance"])
    assert imbalance[0] > 1.5 and max(imbalance[-10:]) < 1.2, [round(i, 2) for i in imbalance]


@pytest.mark.parametrize(
    "name, flavor",
    [("deepseek_v3", "debugmodel"), ("qwen3", "debugmodel_moe"), ("gpt_oss", "debugmodel")],
)
def test_force_load_balance_reaches_every_moe_model_without_touching_its_flavor(name, flavor):
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(name)
    args = spec.flavor_args(flavor)
    model = ConfigManager().parse_args([]).model
    args.update_from_config(model, max_seq_len=64, moe_force_load_balance=True)
    assert args.moe.force_load_balance
    assert not spec.model_args[flavor].moe.force_load_balance
