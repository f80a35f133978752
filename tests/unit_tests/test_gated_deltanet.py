"""Gated DeltaNet (layers/gated_deltanet.py) against transformers' Qwen3.5 mixer: the same
outputs and gradients in fp32 for a sequence several chunks long with grouped value heads;
the chunked rule equals the token-by-token recurrence; packed documents give each document's
own outputs and gradients; planted errors (decay sign flipped, output gate skipped, the
convolution's earlier taps dropped) fail the comparison."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

from torchtitan.layers import gated_deltanet  # noqa: E402
from torchtitan.layers.gated_deltanet import (  # noqa: E402
    GatedDeltaNet,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

DIM, SEQ, CHUNK = 32, 40, 16
SHAPE = dict(n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=6, conv_kernel=4)


def theirs() -> torch.nn.Module:
    config = transformers.Qwen3_5TextConfig(
        hidden_size=DIM,
        linear_num_key_heads=SHAPE["n_k_heads"],
        linear_num_value_heads=SHAPE["n_v_heads"],
        linear_key_head_dim=SHAPE["k_head_dim"],
        linear_value_head_dim=SHAPE["v_head_dim"],
        linear_conv_kernel_dim=SHAPE["conv_kernel"],
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    module = modeling_qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0).float()
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.uniform_(0.5, 1.5)
            elif "A_log" in name:
                param.uniform_(-1.0, 1.0)
            else:
                param.normal_(0.0, 0.3)
    return module


KEY_DIM = SHAPE["n_k_heads"] * SHAPE["k_head_dim"]
SPLIT = [KEY_DIM, KEY_DIM, SHAPE["n_v_heads"] * SHAPE["v_head_dim"]]
RENAMED = {"in_proj_z": "z_proj", "in_proj_b": "b_proj", "in_proj_a": "a_proj"}


def ours_state(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' names -> ours: the fused q/k/v projection and convolution split."""
    state = {}
    for name, value in hf_state.items():
        module = name.split(".")[0]
        if module == "in_proj_qkv":
            state |= dict(
                zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"), value.split(SPLIT))
            )
        elif module == "conv1d":
            state |= dict(zip(("q_conv", "k_conv", "v_conv"), value.squeeze(1).split(SPLIT)))
        else:
            state[name.replace(module, RENAMED.get(module, module), 1)] = value
    return state


def ours_from(hf: torch.nn.Module, block_causal: bool = False) -> GatedDeltaNet:
    ours = GatedDeltaNet(DIM, **SHAPE, norm_eps=1e-6, chunk_size=CHUNK, block_causal=block_causal)
    ours.load_state_dict(ours_state(hf.state_dict()), strict=True)
    return ours


def inputs(seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    return torch.randn(2, seq, DIM, generator=torch.Generator().manual_seed(seed))


def grads(module: torch.nn.Module, x: torch.Tensor, **kwargs) -> tuple[torch.Tensor, dict]:
    x = x.clone().requires_grad_()
    out = module(x, **kwargs)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), {n: p.grad for n, p in module.named_parameters()} | {"input": x.grad}


def test_same_outputs_and_gradients_as_transformers():
    hf = theirs()
    ours = ours_from(hf)
    out, ours_grads = grads(ours, inputs())
    ref, hf_grads = grads(hf, inputs())
    assert ref.std() > 0.1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    hf_grads = ours_state(hf_grads)
    for name, grad in hf_grads.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(ours_grads[name], grad, rtol=1e-4, atol=1e-5 * scale)


def test_chunked_rule_equals_the_recurrence():
    g = torch.Generator().manual_seed(2)
    q, k = (
        torch.nn.functional.normalize(torch.randn(2, 3, 37, 8, generator=g), dim=-1) for _ in "qk"
    )
    v = torch.randn(2, 3, 37, 5, generator=g)
    decay = -torch.rand(2, 3, 37, generator=g)
    beta = torch.rand(2, 3, 37, generator=g)
    state = torch.randn(2, 3, 8, 5, generator=g)
    out, final = chunk_gated_delta_rule(q, k, v, decay, beta, 8, initial_state=state)
    ref, ref_final = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)


def test_packed_documents_give_each_document_alone():
    """Three documents of 13, 20 and 7 tokens (boundaries inside chunks and between them)."""
    ours = ours_from(theirs(), block_causal=True)
    lengths = [13, 20, 7]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1)
    x = inputs(seed=3)
    packed, packed_grads = grads(ours, x, mask=document_ids)
    starts = [0, 13, 33]
    for start, n in zip(starts, lengths):
        alone, _ = grads(ours, x[:, start : start + n])
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
    x_alone = x.clone().requires_grad_()
    total = sum(
        (ours(x_alone[:, s : s + n]) * torch.linspace(-1, 1, DIM)).sum()
        for s, n in zip(starts, lengths)
    )
    total.backward()
    torch.testing.assert_close(packed_grads["input"], x_alone.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("planted", ["decay sign flipped", "gate skipped", "conv taps dropped"])
def test_planted_errors_fail_the_comparison(planted, monkeypatch):
    hf = theirs()
    ours = ours_from(hf)
    if planted == "decay sign flipped":
        rule = gated_deltanet.chunk_gated_delta_rule
        monkeypatch.setattr(
            gated_deltanet,
            "chunk_gated_delta_rule",
            lambda q, k, v, g, beta, *args, **kw: rule(q, k, v, -g, beta, *args, **kw),
        )
    elif planted == "gate skipped":
        monkeypatch.setattr(ours, "gate_output", lambda normed, z: normed)
    else:
        with torch.no_grad():
            for weight in (ours.q_conv, ours.k_conv, ours.v_conv):
                weight[:, :-1] = 0
    with torch.no_grad():  # a blown-up (non-finite) output fails as well
        assert not torch.allclose(ours(inputs()), hf(inputs()), rtol=1e-3, atol=1e-3)
