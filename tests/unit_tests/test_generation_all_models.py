"""Every registered model generates through the KV cache exactly what it generates without
one, and its logits equal the training forward's (the cache plugs into the attention seam:
GQA, MLA with its softmax scale, MoE)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.generation import generate, kv_cache
from torchtitan.models import BUILTIN_MODELS
from torchtitan.protocols.train_spec import get_train_spec

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NATIVE_MODELS = [name for name in BUILTIN_MODELS if name != "hf"]
"""The hf backend has no flavor of its own (it builds a folder's config.json): its generation
is checked against transformers' in tests/unit_tests/test_hf_backend.py."""
DEBUG_FLAVORS = [
    (name, flavor)
    for name in NATIVE_MODELS
    for flavor in get_train_spec(name).model_args
    if flavor.startswith("debugmodel")
]
# MLA with YaRN: its softmax scale is not 1 / sqrt(head_dim), so a cache that dropped the
# scale would give other logits.
# gpt-oss with a window of 4: the 7-token prompt and the new tokens outrun it, so the cache
# must drop keys beyond the window on its sliding layers (and keep them on the full ones).
CASES = [(name, flavor, {}) for name, flavor in DEBUG_FLAVORS] + [
    ("deepseek_v3", "debugmodel", {"rope_factor": 40.0, "rope_original_seq_len": 16}),
    ("gpt_oss", "debugmodel", {"attention_window": 4}),
]


def build(name: str, flavor: str, overrides: dict) -> torch.nn.Module:
    spec = get_train_spec(name)
    args = dataclasses.replace(spec.flavor_args(flavor), max_seq_len=64, **overrides)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=0)
    return model.eval()


def test_every_registered_model_has_a_debug_flavor():
    assert {name for name, _ in DEBUG_FLAVORS} == set(NATIVE_MODELS)


@pytest.mark.parametrize("name, flavor, overrides", CASES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_cache_gives_the_no_cache_tokens(name, flavor, overrides, temperature):
    model = build(name, flavor, overrides)
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=8, temperature=temperature, seed=3)
    cached = generate(model, prompt, use_kv_cache=True, **kwargs)
    assert cached.shape == (2, 7 + 8)
    assert torch.equal(cached, generate(model, prompt, use_kv_cache=False, **kwargs))


@pytest.mark.parametrize("name, flavor, overrides", CASES)
@torch.no_grad()
def test_kv_cache_logits_equal_the_training_forward(name, flavor, overrides):
    model = build(name, flavor, overrides)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with kv_cache(model, max_len=9):
        pieces = [model(tokens[:, :5], positions=torch.arange(5))]
        pieces += [
            model(tokens[:, p : p + 1], positions=torch.arange(p, p + 1)) for p in range(5, 9)
        ]
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(tokens), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_sliding_layer_caches_only_its_window():
    """gpt-oss with a window of 4: after a 7-token prompt and 8 tokens one at a time, its
    sliding layers hold the last 3 positions (all a next query can see), its full layers
    all 15; the logits still equal the training forward's."""
    model = build("gpt_oss", "debugmodel", {"attention_window": 4})
    tokens = torch.randint(0, 256, (1, 15), generator=torch.Generator().manual_seed(1))
    with kv_cache(model, max_len=15) as caches:
        logits = [model(tokens[:, :7], positions=torch.arange(7))]
        for p in range(7, 15):
            logits.append(model(tokens[:, p : p + 1], positions=torch.arange(p, p + 1)))
    held = {(c.sliding_window, c.keys.shape[2] if c.sliding_window else c.length) for c in caches}
    assert held == {(4, 3), (None, 15)}, held
    torch.testing.assert_close(torch.cat(logits, dim=1), model(tokens), rtol=1e-4, atol=1e-4)
