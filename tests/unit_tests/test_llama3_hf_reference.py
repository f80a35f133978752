"""Our Llama 3 against Hugging Face's ``LlamaForCausalLM``: same weights -> same logits.

This is the check that the model *is* Llama 3 (RoPE layout and scaling, GQA,
SwiGLU, norms), not merely self-consistent.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtitan.models.llama3.args import TransformerModelArgs  # noqa: E402
from torchtitan.models.llama3.flavors import llama3_flavors  # noqa: E402
from torchtitan.models.llama3.model import Transformer, rope_inv_freq  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import (  # noqa: E402
    Llama3StateDictAdapter,
    from_hf_config,
    to_hf_config,
)

SEQ_LEN = 48
VOCAB = 128
TOLERANCE = 1e-5

PLAIN_ROPE = {"rope_theta": 500000.0, "rope_type": "default"}
# A small original context so that, within SEQ_LEN positions, the Llama 3.1
# scaling touches kept, smoothed and fully scaled frequency bands alike.
SCALED_ROPE = {
    "rope_theta": 10000.0,
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def hf_model(rope_parameters: dict) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        intermediate_size=96,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        initializer_range=0.1,  # peaky attention, so layout mistakes show in the logits
        rope_parameters=dict(rope_parameters),
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).float().eval()
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # tell the two norms of a block apart
                param.uniform_(0.5, 1.5)
    return model


def our_model(args: TransformerModelArgs, state_dict: dict | None = None) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model.eval()


def random_tokens(batch: int, seq_len: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(params=[PLAIN_ROPE, SCALED_ROPE], ids=["rope", "llama3.1-scaled-rope"])
def hf(request) -> transformers.LlamaForCausalLM:
    return hf_model(request.param)


def test_config_translation(hf) -> None:
    args = from_hf_config(hf.config.to_dict())
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads) == (64, 2, 4, 2)
    assert args.ffn_hidden_dim == 96
    assert args.use_scaled_rope == (hf.config.rope_parameters["rope_type"] == "llama3")
    torch.testing.assert_close(rope_inv_freq(args), hf.model.rotary_emb.inv_freq)


@torch.no_grad()
def test_logits_match_hf(hf) -> None:
    args = from_hf_config(hf.config.to_dict())
    adapter = Llama3StateDictAdapter(args)
    ours = our_model(args, adapter.from_hf(hf.state_dict()))
    tokens = random_tokens(2, SEQ_LEN, seed=1)
    expected = hf(tokens).logits
    assert expected.std() > 0.3  # the comparison is not trivially satisfied
    assert max_abs_diff(ours(tokens), expected) < TOLERANCE


@torch.no_grad()
def test_logits_match_hf_with_explicit_positions(hf) -> None:
    """Positions as load-balanced context parallelism passes them: two chunks of
    a longer sequence, so relative distances jump (a uniform shift would not
    change the logits)."""
    args = from_hf_config(hf.config.to_dict())
    ours = our_model(args, Llama3StateDictAdapter(args).from_hf(hf.state_dict()))
    tokens = random_tokens(2, 16, seed=2)
    positions = torch.cat([torch.arange(0, 8), torch.arange(40, 48)]).expand(2, 16)
    # An explicit all-ones mask stops HF from reading the jump as a packed-sequence boundary.
    expected = hf(tokens, attention_mask=torch.ones_like(tokens), position_ids=positions).logits
    assert max_abs_diff(ours(tokens, positions=positions), expected) < TOLERANCE
    assert max_abs_diff(ours(tokens), expected) > 1e-3  # positions do matter


@torch.no_grad()
def test_our_weights_run_in_hf(hf) -> None:
    args = from_hf_config(hf.config.to_dict())
    ours = our_model(args)
    theirs = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**to_hf_config(args), attn_implementation="eager")
    ).eval()
    theirs.load_state_dict(Llama3StateDictAdapter(args).to_hf(ours.state_dict()), strict=True)
    tokens = random_tokens(2, SEQ_LEN, seed=3)
    assert max_abs_diff(ours(tokens), theirs(tokens).logits) < TOLERANCE


def test_round_trips_are_bit_exact(hf) -> None:
    args = from_hf_config(hf.config.to_dict())
    adapter = Llama3StateDictAdapter(args)
    hf_sd = hf.state_dict()
    back = adapter.to_hf(adapter.from_hf(hf_sd))
    assert back.keys() == hf_sd.keys()
    for key, value in hf_sd.items():
        assert torch.equal(back[key], value), key
    ours_sd = our_model(args).state_dict()
    again = adapter.from_hf(adapter.to_hf(ours_sd))
    assert again.keys() == ours_sd.keys()
    for key, value in ours_sd.items():
        assert torch.equal(again[key], value), key
    q = "layers.0.attention.wq.weight"
    permuted = adapter.to_hf({q: ours_sd[q]})["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(permuted, ours_sd[q])


def test_unknown_keys_are_rejected() -> None:
    adapter = Llama3StateDictAdapter(llama3_flavors["debugmodel_tiny"])
    with pytest.raises(ValueError, match="rotary_emb.inv_freq"):
        adapter.from_hf({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)})
    with pytest.raises(ValueError, match="layers.0.attention.bogus"):
        adapter.to_hf({"layers.0.attention.bogus": torch.zeros(4)})
    with pytest.raises(ValueError, match="rows"):
        adapter.to_hf({"layers.0.attention.wk.weight": torch.zeros(3, 64)})


@pytest.mark.parametrize("flavor", ["8B", "70B", "405B", "debugmodel_tiny"])
def test_flavor_config_round_trip(flavor: str) -> None:
    args = llama3_flavors[flavor]
    hf_dict = to_hf_config(args)
    config = transformers.LlamaConfig(**hf_dict)
    assert config.intermediate_size == args.ffn_hidden_dim
    assert config.head_dim == args.head_dim
    expected_type = "llama3" if args.use_scaled_rope else "default"
    assert config.rope_parameters["rope_type"] == expected_type
    back = from_hf_config(config.to_dict())
    for field in (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "ffn_hidden_dim",
        "norm_eps",
        "rope_theta",
        "use_scaled_rope",
        "max_seq_len",
    ):
        assert getattr(back, field) == getattr(args, field), field
    if args.use_scaled_rope:
        torch.testing.assert_close(rope_inv_freq(back), rope_inv_freq(args), rtol=0, atol=0)
