"""Muon (``optimizer.name = "Muon"``) on one process: the same steps as ``torch.optim.Muon``
for the weight matrices and ``torch.optim.AdamW`` for the rest (a planted error, one
Newton-Schulz step less, is caught), experts orthogonalised one by one, which parameters go
where, the state dict, and the one-line refusals of its settings."""

from __future__ import annotations

import fnmatch
import re

import pytest
import torch

from tests.unit_tests.optimizer_steps import ours, tiny_model, train
from torchtitan.components.optimizers import muon as muon_module
from torchtitan.components.optimizers.builder import build_optimizers, muon_split
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.config.checks import check_job_config
from torchtitan.models.llama3.model import Transformer


def config(*args: str):
    """Muon with torch.optim.Muon's bf16 iteration (auto would pick fp32 on a CPU that
    emulates bf16)."""
    return ConfigManager().parse_args(
        ["--optimizer.name", "Muon", "--optimizer.muon.ns_dtype", "bfloat16", *args]
    )


def reference_steps(model: Transformer, args, ns_dtype=torch.bfloat16):
    """torch.optim.Muon on the same matrices, torch.optim.AdamW on the rest (norms and
    embeddings without weight decay, as ``optimizer.weight_decay_exclude``'s default)."""
    muon, adamw, _ = muon_split([model], args.muon.adamw_params)
    m = args.muon
    reference = torch.optim.Muon(
        muon[0],
        lr=args.lr,
        weight_decay=args.weight_decay,
        momentum=m.momentum,
        nesterov=m.nesterov,
        ns_coefficients=tuple(m.ns_coefficients),
        eps=m.eps,
        ns_steps=m.ns_steps,
        adjust_lr_fn=m.adjust_lr,
    )
    names = {id(p): n for n, p in model.named_parameters()}

    def exempt(p: torch.nn.Parameter) -> bool:
        return any(fnmatch.fnmatchcase(names[id(p)], x) for x in args.weight_decay_exclude)

    assert not any(exempt(p) for p in muon[0])  # the default exempts no block matrix
    other = torch.optim.AdamW(
        [
            {"params": [p for p in adamw[0] if not exempt(p)]},
            {"params": [p for p in adamw[0] if exempt(p)], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
        weight_decay=args.weight_decay,
        foreach=False,
    )

    def step():
        for opt in (reference, other):
            opt.step()
            opt.zero_grad()

    return step


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_equal_to_torch_muon_and_adamw_over_five_steps(adjust_lr):
    args = config(
        "--optimizer.muon.adjust_lr", adjust_lr, "--optimizer.implementation", "for-loop"
    ).optimizer
    expected = train(model := tiny_model(), reference_steps(model, args))
    got = train(model := tiny_model(), ours(model, args)[0])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def test_one_newton_schulz_step_less_is_caught(monkeypatch):
    args = config("--optimizer.implementation", "for-loop").optimizer
    expected = train(model := tiny_model(), reference_steps(model, args))
    iterate = muon_module.newton_schulz
    monkeypatch.setattr(
        muon_module, "newton_schulz", lambda u, c, steps, *a: iterate(u, c, steps - 1, *a)
    )
    got = train(model := tiny_model(), ours(model, args)[0])
    assert max((g - e).abs().max().item() for e, g in zip(expected, got)) > 1e-4


def test_parameters_split_matrices_to_muon_the_rest_to_adamw():
    model = tiny_model()
    muon, adamw, matches = muon_split([model], ["tok_embeddings.*", "output.*"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in adamw[0]} == {
        n
        for n, p in model.named_parameters()
        if p.ndim == 1 or n.split(".")[0] in ("tok_embeddings", "output")
    }
    assert all(p.ndim == 2 for p in muon[0]) and len(muon[0]) == 7 * 4
    assert matches == {"tok_embeddings.*": 1, "output.*": 1}


def test_experts_are_orthogonalised_one_by_one():
    stack = torch.randn(3, 8, 5, generator=torch.Generator().manual_seed(0))
    batched = muon_module.newton_schulz(stack, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
    for expert, result in zip(stack, batched):
        alone = muon_module.newton_schulz(expert, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
        # batched and single matmuls round differently: fp32 noise after 5 iterations, not 1e-6
        torch.testing.assert_close(result, alone, rtol=1e-4, atol=1e-5)


def test_state_is_one_momentum_buffer_per_matrix_and_round_trips():
    model = tiny_model()
    step, optimizers = ours(model, config().optimizer)
    train(model, step)
    state = optimizers.state_dict()
    assert "state.layers.0.attention.wq.weight.momentum_buffer" in state
    assert not any(k.startswith("state.layers.0.attention.wq.weight.exp_avg") for k in state)
    assert "state.tok_embeddings.weight.exp_avg_sq" in state
    optimizers.load_state_dict(state)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--optimizer.muon.momentum", "0.9"], "optimizer.muon.momentum: a Muon setting"),
        (
            ["--optimizer.name", "Muon", "--optimizer.muon.ns_steps", "0"],
            "optimizer.muon.ns_steps: must be in [1, 100)",
        ),
    ],
)
def test_bad_settings_are_one_line_errors(args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_job_config(ConfigManager().parse_args(args))


def test_auto_iteration_dtype_follows_the_device():
    from torchtitan.tools.cpu_precision import matmul_speed

    cpu = "bfloat16" if matmul_speed(torch.bfloat16).native else "float32"
    assert muon_module.resolve_ns_dtype("auto", "cpu") == cpu
    assert muon_module.resolve_ns_dtype("auto", "cuda") == "bfloat16"
    assert muon_module.resolve_ns_dtype("float32", "cuda") == "float32"


def test_a_pattern_that_matches_nothing_is_refused():
    args = config("--optimizer.muon.adamw_params", "tok_embeddings.*,head.*").optimizer
    with pytest.raises(ConfigError, match="'head.\\*' matches no parameter"):
        build_optimizers([tiny_model()], args, None)


def test_the_default_trains_transformers_embedding_and_output_with_adamw():
    """The hf backend's names (``model.embed_tokens``, ``lm_head``): the default patterns
    send them to AdamW, and the native names matching nothing there is no error."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(32, 8)
    model.model.proj = torch.nn.Linear(8, 8, bias=False)
    model.lm_head = torch.nn.Linear(8, 32, bias=False)
    args = config().optimizer
    muon, adamw, _ = muon_split([model], args.muon.adamw_params)
    assert muon[0] == [model.model.proj.weight]
    assert adamw[0] == [model.model.embed_tokens.weight, model.lm_head.weight]
    build_optimizers([model], args, None)
