"""Single-process checks of the Llama 3 model: initialisation, forward, RoPE, FLOPs."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchtitan.layers.init import clean_fqn, init_param_, normal_init, param_seed
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer, apply_rotary_emb, precompute_rope_cache

TINY = llama3_flavors["debugmodel_tiny"]


def tiny_args(**overrides) -> TransformerModelArgs:
    return dataclasses.replace(TINY, max_seq_len=64, **overrides)


def build(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# --- initialisation -----------------------------------------------------------------


def test_init_is_deterministic_and_seed_dependent() -> None:
    a, b, c = build(tiny_args()), build(tiny_args()), build(tiny_args(), seed=1)
    assert_same_state(a, b)
    for (name, pa), pc in zip(a.named_parameters(), c.parameters()):
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_init_values_follow_fqn_not_layout() -> None:
    """A pipeline stage that deleted layers gets the kept layers' values unchanged."""
    full = build(tiny_args())
    with torch.device("meta"):
        stage = Transformer(tiny_args())
    del stage.layers["1"], stage.layers["2"]
    stage.output = None
    stage.to_empty(device="cpu")
    stage.init_weights(0)
    full_state = full.state_dict()
    for key, value in stage.state_dict().items():
        assert torch.equal(value, full_state[key]), key
    assert "layers.3.attention.wq.weight" in stage.state_dict()


def test_init_sees_through_wrapper_prefixes() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    full = build(tiny_args())
    with torch.device("meta"):
        wrapped = Transformer(tiny_args())
    wrapped.layers["0"] = checkpoint_wrapper(wrapped.layers["0"])
    names = [n for n, _ in wrapped.named_parameters()]
    assert any("_checkpoint_wrapped_module." in n for n in names)
    wrapped.to_empty(device="cpu")
    wrapped.init_weights(0)
    full_params = dict(full.named_parameters())
    for name, param in wrapped.named_parameters():
        assert torch.equal(param, full_params[clean_fqn(name)]), name


def test_clean_fqn() -> None:
    name = "layers.0._fsdp_wrapped_module._checkpoint_wrapped_module._orig_mod.attention.wq.weight"
    assert clean_fqn(name) == "layers.0.attention.wq.weight"
    assert clean_fqn("norm.weight") == "norm.weight"


def test_param_seed_is_stable() -> None:
    # Pinned: must never change across processes, runs or Python versions
    # (unlike the built-in hash(), which is salted per process).
    assert param_seed(0, "norm.weight") == 1870747774715189417
    assert param_seed(123, "layers.0.attention.wq.weight") == 6827184562506319599
    assert param_seed(1, "norm.weight") != param_seed(0, "norm.weight")


def test_init_distributions() -> None:
    args = tiny_args(n_layers=2)
    model = build(args)
    std0 = 0.02 / (2 * 1) ** 0.5
    wo = model.layers["0"].attention.wo.weight
    assert wo.abs().max() <= 2 * std0 + 1e-7
    assert wo.std().item() == pytest.approx(std0 * 0.88, rel=0.2)  # truncation shrinks std
    w3_1 = model.layers["1"].feed_forward.w3.weight
    assert w3_1.abs().max() <= 2 * 0.02 / 2 + 1e-7
    out = model.output.weight
    assert out.abs().max() <= 3 * args.dim**-0.5 + 1e-6
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(args.dim))

    flat = build(tiny_args(n_layers=2, depth_init=False))
    assert flat.layers["0"].attention.wo.weight.abs().max() <= 2 * 0.02 / 2 + 1e-7


def test_init_low_precision_params() -> None:
    fp32 = build(tiny_args())
    bf16 = build(tiny_args())
    bf16.to(torch.bfloat16)
    bf16.init_weights(0)
    for (name, p32), p16 in zip(fp32.named_parameters(), bf16.parameters()):
        assert p16.dtype == torch.bfloat16
        assert torch.equal(p32.to(torch.bfloat16), p16), name


def test_rope_cache_recomputed_and_not_persistent() -> None:
    model = build(tiny_args())
    assert "rope_cache" not in model.state_dict()
    assert torch.equal(model.rope_cache, precompute_rope_cache(model.model_args))


def test_init_dtensor_gets_its_slice(fake_rank1_of_2) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.empty(5, 6)
    init_param_(full, "w", 7, normal_init(1.0))
    expected = {
        (Shard(0),): full.chunk(2, dim=0)[1],
        (Shard(1),): full.chunk(2, dim=1)[1],
        (Replicate(),): full,
    }
    for placements, local in expected.items():
        param = nn.Parameter(
            distribute_tensor(torch.zeros(5, 6), fake_rank1_of_2, placements, src_data_rank=None)
        )
        init_param_(param, "w", 7, normal_init(1.0))
        assert torch.equal(param.to_local(), local), placements


def test_init_under_fully_shard_matches_single_process(fake_rank1_of_2) -> None:
    from torch.distributed.fsdp import fully_shard

    reference = build(tiny_args())
    with torch.device("meta"):
        model = Transformer(tiny_args())
    for layer in model.layers.values():
        fully_shard(layer, mesh=fake_rank1_of_2)
    fully_shard(model, mesh=fake_rank1_of_2)
    model.to_empty(device="cpu")
    model.init_weights(0)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        local = param.to_local()
        rows = ref_params[name].chunk(2, dim=0)[1]
        assert torch.equal(local, rows), name


# --- forward --------------------------------------------------------------------------


def test_forward_shape_and_dtype() -> None:
    args = tiny_args()
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, args.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_forward_is_causal() -> None:
    args = tiny_args()
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % args.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_pipeline_stages_compose_to_full_model() -> None:
    args = tiny_args()
    full = build(args)
    first, second = copy.deepcopy(full), copy.deepcopy(full)
    for i in ("2", "3"):
        del first.layers[i]
    for i in ("0", "1"):
        del second.layers[i]
    first.norm = first.output = None
    second.tok_embeddings = None
    tokens = torch.randint(0, args.vocab_size, (2, 10))
    torch.testing.assert_close(second(first(tokens)), full(tokens), rtol=0, atol=0)


def test_gqa_forward_backward() -> None:
    args = tiny_args()
    assert args.kv_heads < args.n_heads
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    model(tokens).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


# --- RoPE ------------------------------------------------------------------------------


def test_rope_explicit_positions() -> None:
    args = tiny_args()
    cache = precompute_rope_cache(args)
    xq = torch.randn(2, 20, 8, args.head_dim)
    xk = torch.randn(2, 20, 4, args.head_dim)
    default = apply_rotary_emb(xq, xk, cache)
    explicit = apply_rotary_emb(xq, xk, cache, torch.arange(20))
    for d, e in zip(default, explicit):
        assert torch.equal(d, e)
    # A shard of a longer sequence, given its global positions, matches that slice.
    shard = apply_rotary_emb(xq[:, 5:9], xk[:, 5:9], cache, torch.arange(5, 9).expand(2, 4))
    for d, s in zip(default, shard):
        torch.testing.assert_close(d[:, 5:9], s, rtol=0, atol=0)


def test_rope_pairs_are_adjacent_and_relative() -> None:
    args = tiny_args()
    cache = precompute_rope_cache(args)
    x = torch.zeros(1, 3, 1, args.head_dim)
    x[..., 0] = 1.0  # pair (0, 1) at the highest frequency: rotates by 1 rad / position
    rotated, _ = apply_rotary_emb(x, x, cache)
    for pos in range(3):
        expected = torch.tensor([torch.cos(torch.tensor(pos)), torch.sin(torch.tensor(pos))])
        torch.testing.assert_close(rotated[0, pos, 0, :2], expected.float())
        assert rotated[0, pos, 0, 2:].abs().max() == 0
    # Dot products depend only on relative position.
    q, k = torch.randn(1, 1, 1, args.head_dim), torch.randn(1, 1, 1, args.head_dim)

    def score(pq: int, pk: int) -> torch.Tensor:
        rq, _ = apply_rotary_emb(q, q, cache, torch.tensor([pq]))
        rk, _ = apply_rotary_emb(k, k, cache, torch.tensor([pk]))
        return (rq * rk).sum()

    torch.testing.assert_close(score(7, 3), score(30, 26))


def test_scaled_rope_only_changes_low_frequencies() -> None:
    base = precompute_rope_cache(tiny_args())
    scaled = precompute_rope_cache(tiny_args(use_scaled_rope=True))
    half = TINY.head_dim // 2
    assert torch.equal(base[:, 0], scaled[:, 0])  # highest frequency untouched
    assert not torch.equal(base[:, half - 1], scaled[:, half - 1])


# --- args, sizes, FLOPs ----------------------------------------------------------------


def meta_model(flavor: str) -> tuple[TransformerModelArgs, Transformer]:
    args = llama3_flavors[flavor]
    with torch.device("meta"):
        return args, Transformer(args)


def test_8b_size_and_flops() -> None:
    args, model = meta_model("8B")
    assert args.ffn_hidden_dim == 14336
    nparams, flops = args.get_nparams_and_flops(model, seq_len=8192)
    assert nparams == 8_030_261_248
    embedding = 128256 * 4096
    attention = 12 * 32 * 32 * 128 * 8192
    assert flops == 6 * (nparams - embedding) + attention


def test_70b_and_405b_sizes() -> None:
    args70, model70 = meta_model("70B")
    assert args70.ffn_hidden_dim == 28672
    assert args70.get_nparams_and_flops(model70, 8192)[0] == pytest.approx(70.55e9, rel=1e-3)
    args405, model405 = meta_model("405B")
    assert args405.ffn_hidden_dim == 53248
    assert args405.get_nparams_and_flops(model405, 8192)[0] == pytest.approx(405.8e9, rel=1e-3)


def test_tiny_flavor_is_small() -> None:
    args, model = meta_model("debugmodel_tiny")
    assert args.n_heads % 4 == 0 and args.kv_heads % 4 == 0
    assert args.get_nparams_and_flops(model, 64)[0] < 250_000


def test_update_from_config() -> None:
    from torchtitan.config import ConfigManager
    from torchtitan.recipe import max_seq_len

    args = tiny_args()
    job_config = ConfigManager().parse_args(["--training.seq_len", "512"])
    args.update_from_config(
        job_config.model, max_seq_len=max_seq_len(job_config.training, job_config.validation)
    )
    assert args.max_seq_len == 512 and args.vocab_size == TINY.vocab_size
    with_validation = ConfigManager().parse_args(
        ["--training.seq_len", "512", "--validation.enable", "--validation.seq_len", "1024"]
    )
    args.update_from_config(
        with_validation.model,
        max_seq_len=max_seq_len(with_validation.training, with_validation.validation),
    )
    assert args.max_seq_len == 1024  # RoPE covers the longer validation sequences
    args.update_from_config(
        job_config.model, max_seq_len=512, tokenizer=SimpleNamespace(vocab_size=1000)
    )
    assert args.vocab_size == 1000
    assert TINY.max_seq_len == 2048  # the flavor itself is untouched
