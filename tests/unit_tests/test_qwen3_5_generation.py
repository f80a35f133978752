"""Qwen3.5 generation through the cache context (``generation/kv_cache.py``): its gated
attention layers run a ``KVCacheAttention``, its Gated DeltaNet layers a
``RecurrentStateCache`` (the convolution's tail and the delta rule's state carried between
calls). With the cache the tokens are those generated without it (greedy and sampled, a
prompt within one delta-rule chunk and one spanning two), each step's logits are the full
forward's at that position, the recurrent state keeps its shape however many tokens follow
(constant memory), the original kernels come back on exit, and planted errors (the
convolution tail or the state dropped between calls) fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.generation import RecurrentStateCache, generate, kv_cache
from torchtitan.generation.kv_cache import KVCacheAttention
from torchtitan.layers.attention import LOCAL_KERNELS
from torchtitan.layers.gated_deltanet import DeltaRule, GatedDeltaNet, RecurrentSpec
from torchtitan.models.qwen3_5.flavors import qwen3_5_flavors
from torchtitan.models.qwen3_5.model import Qwen3_5Model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FLAVORS = ["debugmodel", "debugmodel_moe"]
NEW_TOKENS = 20
# 7: the prompt within one chunk of the delta rule (16 in the debug flavors); 21: across two,
# so the prompt's chunked rule carries a state from one chunk to the next before generation
PROMPT_LENS = [7, 21]
TOLERANCE = 1e-5


def build(flavor: str) -> Qwen3_5Model:
    args = dataclasses.replace(qwen3_5_flavors[flavor], max_seq_len=64)
    with torch.device("meta"):
        model = Qwen3_5Model(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=0)
    return model.eval()


@pytest.fixture(scope="module", params=FLAVORS)
def model(request) -> Qwen3_5Model:
    return build(request.param)


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))


def kernels(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (*LOCAL_KERNELS, DeltaRule))]


@torch.no_grad()
def step_by_step(model: Qwen3_5Model, tokens: torch.Tensor, prompt_len: int):
    """The logits of ``tokens`` through the cache: the prompt in one call, then one token a
    call (as ``generate`` feeds them); with the cached states' shapes after the prompt and
    at the end."""
    with kv_cache(model, max_len=tokens.shape[1]) as caches:
        logits = [model(tokens[:, :prompt_len], positions=torch.arange(prompt_len))]
        rules = [c for c in caches if isinstance(c, RecurrentStateCache)]
        after_prompt = [(c.conv_tail.shape, c.state.shape) for c in rules]
        for p in range(prompt_len, tokens.shape[1]):
            logits.append(model(tokens[:, p : p + 1], positions=torch.arange(p, p + 1)))
        at_end = [(c.conv_tail.shape, c.state.shape) for c in rules]
    return torch.cat(logits, dim=1), caches, after_prompt, at_end


@pytest.mark.parametrize("prompt_len", PROMPT_LENS)
@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, None), (0.8, 20)])
def test_cache_gives_the_no_cache_tokens(model, prompt_len, temperature, top_k):
    tokens = prompt(prompt_len)
    kwargs = dict(max_new_tokens=NEW_TOKENS, temperature=temperature, top_k=top_k, seed=3)
    cached = generate(model, tokens, use_kv_cache=True, **kwargs)
    assert cached.shape == (2, prompt_len + NEW_TOKENS)
    assert torch.equal(cached, generate(model, tokens, use_kv_cache=False, **kwargs))


@pytest.mark.parametrize("prompt_len", PROMPT_LENS)
@torch.no_grad()
def test_each_step_gives_the_full_forward_logits(model, prompt_len):
    # the sequence the model itself generates, then every step's logits against one forward
    tokens = generate(model, prompt(prompt_len, seed=1), max_new_tokens=NEW_TOKENS, seed=4)
    original = kernels(model)
    logits, caches, _, _ = step_by_step(model, tokens, prompt_len)
    torch.testing.assert_close(logits, model(tokens), rtol=TOLERANCE, atol=TOLERANCE)
    assert [type(c) for c in caches].count(KVCacheAttention) == 1  # one gated attention layer
    assert [type(c) for c in caches].count(RecurrentStateCache) == 3  # three DeltaNet layers
    assert all(c.length == tokens.shape[1] for c in caches)
    assert kernels(model) == original, "the original kernels must be restored"
    assert all(type(k) is not RecurrentStateCache for k in kernels(model))


@torch.no_grad()
def test_the_recurrent_state_keeps_its_shape(model):
    """Constant memory: after 20 more tokens the convolution tail is still the last K - 1 = 3
    inputs of the q/k/v channels and the state one [k_dim, v_dim] matrix per value head."""
    args = model.model_args
    channels = 2 * args.delta_rule_n_k_heads * args.delta_rule_k_head_dim
    channels += args.delta_rule_n_v_heads * args.delta_rule_v_head_dim
    expected = (
        torch.Size([2, args.delta_rule_conv_kernel - 1, channels]),
        torch.Size(
            [2, args.delta_rule_n_v_heads, args.delta_rule_k_head_dim, args.delta_rule_v_head_dim]
        ),
    )
    tokens = prompt(21 + NEW_TOKENS, seed=2)
    _, caches, after_prompt, at_end = step_by_step(model, tokens, 21)
    assert after_prompt == at_end == [expected] * 3
    rules = [c for c in caches if isinstance(c, RecurrentStateCache)]
    assert all(c.state.dtype == torch.float32 for c in rules)
    # the KV cache of the attention layer, by contrast, holds every position
    (attention,) = [c for c in caches if isinstance(c, KVCacheAttention)]
    assert attention.length == tokens.shape[1]


def drop_conv_tail(self, x, weight, mask=None):
    self.conv_tail = None  # every call starts the convolution from zeros
    return ORIGINAL_CONV(self, x, weight, mask)


def drop_state(self, q, k, v, g, beta, *, mask=None):
    self.state = None  # every call starts the delta rule from a zero state
    return ORIGINAL_FORWARD(self, q, k, v, g, beta, mask=mask)


ORIGINAL_CONV = RecurrentStateCache.conv
ORIGINAL_FORWARD = RecurrentStateCache.forward


@pytest.mark.parametrize(
    "method, planted", [("conv", drop_conv_tail), ("forward", drop_state)], ids=["tail", "state"]
)
@torch.no_grad()
def test_planted_errors_fail(model, monkeypatch, method, planted):
    """A cache that forgets the convolution tail or the state between calls still gets the
    prompt right but not the steps after it: their logits leave the full forward's by far
    more than the tolerance (the debug models' small initial logits keep their greedy and
    sampled tokens, so the logits are what the step-by-step test compares)."""
    tokens = generate(model, prompt(21), max_new_tokens=NEW_TOKENS, temperature=0.0)
    full = model(tokens)
    monkeypatch.setattr(RecurrentStateCache, method, planted)
    logits, *_ = step_by_step(model, tokens, 21)
    torch.testing.assert_close(logits[:, :21], full[:, :21], rtol=TOLERANCE, atol=TOLERANCE)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(logits, full, rtol=TOLERANCE, atol=TOLERANCE)
    assert (logits[:, 21:] - full[:, 21:]).abs().max() > 10 * TOLERANCE


@torch.no_grad()
def test_a_deltanet_alone_continues_across_calls_of_any_length():
    """A Gated DeltaNet mixer without attention (the cache context needs no attention layer):
    pieces of 5, 2 (fewer tokens than the convolution's tail), 14 (the chunked rule from a
    stored state, across a chunk boundary) and single tokens give the whole sequence's
    output. Slow decays (0.05 .. 0.37 per token) so the state carries far."""
    mixer = GatedDeltaNet(32, 2, 4, 8, 8, conv_kernel=4, norm_eps=1e-6, chunk_size=8)
    generator = torch.Generator().manual_seed(0)
    for name, param in mixer.named_parameters():
        if name == "A_log":
            param.uniform_(-3.0, -1.0, generator=generator)
        elif name in ("dt_bias", "norm.weight"):
            param.uniform_(0.5, 1.5, generator=generator)
        else:
            param.normal_(0.0, 0.3, generator=generator)
    x = torch.randn(2, 24, 32, generator=generator)
    with kv_cache(mixer, max_len=24) as caches:
        (cache,) = caches
        pieces, start = [], 0
        for size in (5, 2, 14, 1, 1, 1):
            pieces.append(mixer(x[:, start : start + size]))
            start += size
        assert cache.length == 24 and cache.conv_tail.shape == (2, 3, 2 * 16 + 32)
    assert type(mixer.inner_rule) is DeltaRule
    torch.testing.assert_close(torch.cat(pieces, dim=1), mixer(x), rtol=1e-5, atol=1e-5)


def test_document_ids_are_refused():
    """A prompt is one document: the cache does not restart its state within a call."""
    rule = DeltaRule(16, RecurrentSpec(block_causal=True))
    cache = RecurrentStateCache(rule.chunk_size, rule.spec)
    document_ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="one document per row"):
        cache.conv(torch.zeros(1, 2, 4), torch.zeros(4, 4), mask=rule.prepare(document_ids, None))
