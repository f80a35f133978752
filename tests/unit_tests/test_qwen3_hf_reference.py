"""Our Qwen3 and Qwen3-MoE against Hugging Face's ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``:
random tiny models loaded through our state-dict adapter give the same logits in fp32
(per-head q/k norms, rotate-half RoPE permuted to our layout, GQA with head_dim != dim /
n_heads, tied embeddings, softmax top-k routing with renormalised weights, YaRN rope scaling);
exports round-trip
bit-exactly and run in transformers; planted errors fail the comparison."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from torchtitan.layers.moe import MoEArgs  # noqa: E402
from torchtitan.models.qwen3.args import Qwen3ModelArgs  # noqa: E402
from torchtitan.models.qwen3.flavors import qwen3_flavors  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Model  # noqa: E402
from torchtitan.models.qwen3.state_dict_adapter import (  # noqa: E402
    Qwen3StateDictAdapter,
    from_hf_config,
    to_hf_config,
)

VOCAB, SEQ_LEN, TOLERANCE = 96, 40, 1e-5

DENSE = Qwen3ModelArgs(
    vocab_size=VOCAB,
    dim=48,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_hidden_dim=80,
    rope_theta=10000.0,
    max_seq_len=64,
)
TIED = dataclasses.replace(DENSE, tie_word_embeddings=True)
MOE = dataclasses.replace(
    DENSE,
    moe_hidden_dim=24,
    moe=MoEArgs(
        num_experts=8,
        num_shared_experts=0,
        top_k=3,
        score_func="softmax",
        route_norm=True,
        load_balance_coeff=None,
    ),
)
# YaRN as published Qwen3 configs extend the context: factor 4 over an original 16 positions
# (within SEQ_LEN, so both the kept and the interpolated frequency bands are exercised).
YARN = dataclasses.replace(DENSE, rope_factor=4.0, rope_original_seq_len=16)
CASES = {"dense": DENSE, "tied": TIED, "moe": MOE, "yarn": YARN}


def hf_config(args: Qwen3ModelArgs):
    cls = transformers.Qwen3Config if args.moe is None else transformers.Qwen3MoeConfig
    fields = {
        k: v for k, v in to_hf_config(args).items() if k not in ("architectures", "model_type")
    }
    return cls(**fields, initializer_range=0.1, attn_implementation="eager")


def hf_model(args: Qwen3ModelArgs):
    cls = transformers.Qwen3ForCausalLM if args.moe is None else transformers.Qwen3MoeForCausalLM
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        model = cls(hf_config(args)).float().eval()
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # q/k norms and block norms all distinct
                param.uniform_(0.5, 1.5)
    return model


def our_model(args: Qwen3ModelArgs, state_dict: dict | None = None) -> Qwen3Model:
    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model.eval()


def tokens(seed: int = 1, seq_len: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_logit_error(ours: Qwen3Model, hf, batch: torch.Tensor) -> float:
    return (ours(batch) - hf(batch).logits).abs().max().item()


@pytest.fixture(params=list(CASES), scope="module")
def case(request, tmp_path_factory):
    """(args, Hugging Face model, our model loaded from its save_pretrained files)."""
    args = CASES[request.param]
    hf = hf_model(args)
    folder = tmp_path_factory.mktemp(f"qwen3_{request.param}")
    hf.save_pretrained(folder)  # the published layout: one tensor per expert, no tied lm_head
    ours = our_model(
        args, Qwen3StateDictAdapter(args).from_hf(load_file(folder / "model.safetensors"))
    )
    return args, hf, ours, folder


def test_same_logits_as_hugging_face(case):
    args, hf, ours, _ = case
    batch = tokens()
    with torch.no_grad():
        assert hf(batch).logits.std() > 0.3  # not trivially satisfied
    assert max_logit_error(ours, hf, batch) < TOLERANCE


@torch.no_grad()
def test_same_logits_at_explicit_positions(case):
    """Positions as load-balanced context parallel passes them (two chunks of a longer sequence)."""
    _, hf, ours, _ = case
    batch = tokens(seed=2, seq_len=16)
    positions = torch.cat([torch.arange(0, 8), torch.arange(40, 48)]).expand(2, 16)
    expected = hf(batch, attention_mask=torch.ones_like(batch), position_ids=positions).logits
    assert (ours(batch, positions=positions) - expected).abs().max().item() < TOLERANCE


def test_export_round_trip_is_bit_exact_and_loads_in_transformers(case, tmp_path):
    args, hf, ours, folder = case
    adapter = Qwen3StateDictAdapter(args)
    on_disk = load_file(folder / "model.safetensors")
    exported = adapter.to_hf(ours.state_dict())
    assert exported.keys() == on_disk.keys()
    assert all(torch.equal(exported[k], on_disk[k]) for k in on_disk)
    again = adapter.from_hf(exported)
    assert again.keys() == ours.state_dict().keys()
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())

    fresh = our_model(args)  # our own random weights, written as a checkpoint folder
    save_file(
        {k: v.contiguous() for k, v in adapter.to_hf(fresh.state_dict()).items()},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    (tmp_path / "config.json").write_text(
        json.dumps(adapter.hf_config() | {"torch_dtype": "float32"})
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    assert type(theirs) is type(hf)
    assert max_logit_error(fresh, theirs.eval(), tokens(seed=3)) < TOLERANCE


def test_reads_transformers_fused_in_memory_experts():
    hf = hf_model(MOE)
    adapter = Qwen3StateDictAdapter(MOE)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    assert (
        max_logit_error(our_model(MOE, adapter.from_hf(hf.state_dict())), hf, tokens()) < TOLERANCE
    )


def test_skipping_the_qk_norms_fails_the_comparison(case):
    args, hf, ours, _ = case
    for block in ours.layers.values():
        block.attention.qk_norm = False
    try:
        assert max_logit_error(ours, hf, tokens()) > 1e-3
    finally:
        for block in ours.layers.values():
            block.attention.qk_norm = True


def test_plain_rope_fails_the_yarn_comparison():
    """Both halves of YaRN matter: the scaled frequencies and the attention factor."""
    hf = hf_model(YARN)
    state = Qwen3StateDictAdapter(YARN).from_hf(hf.state_dict())
    for planted in (
        dataclasses.replace(YARN, rope_attention_factor=1.0),
        dataclasses.replace(YARN, rope_factor=1.0),
    ):
        assert max_logit_error(our_model(planted, state), hf, tokens()) > 1e-3


def test_yarn_config_json_loads_as_published():
    """A published-style config.json (YaRN in rope_scaling, transformers 4.x form)."""
    config = to_hf_config(qwen3_flavors["8B"]) | {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        }
    }
    del config["rope_parameters"]
    args = from_hf_config(config)
    assert (args.rope_factor, args.rope_original_seq_len, args.rope_attention_factor) == (
        4.0,
        32768,
        None,
    )
    assert args.softmax_scale == pytest.approx(128**-0.5 * (0.1 * math.log(4.0) + 1) ** 2)
    with pytest.raises(
        ValueError, match="has rope_scaling = {'rope_type': 'yarn', .* but model.flavor gives None"
    ):
        Qwen3StateDictAdapter(qwen3_flavors["8B"]).check_hf_config(config)


def test_unnormalised_top_k_weights_fail_the_comparison():
    hf = hf_model(MOE)
    planted = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, route_norm=False))
    ours = our_model(planted, Qwen3StateDictAdapter(MOE).from_hf(hf.state_dict()))
    assert max_logit_error(ours, hf, tokens()) > 1e-3


def test_qk_norm_weights_are_permuted():
    """A q-norm weight must follow its channels into the rotate-half layout."""
    adapter = Qwen3StateDictAdapter(DENSE)
    weight = torch.arange(16.0)
    hf = adapter.to_hf({"layers.0.attention.q_norm.weight": weight})[
        "model.layers.0.self_attn.q_norm.weight"
    ]
    assert hf.tolist() == [*range(0, 16, 2), *range(1, 16, 2)]


@pytest.mark.parametrize("flavor", list(qwen3_flavors))
def test_flavor_config_round_trips_through_transformers(flavor):
    args = qwen3_flavors[flavor]
    config = hf_config(args).to_dict()
    config["architectures"] = to_hf_config(args)["architectures"]
    back = from_hf_config(config)
    assert back == dataclasses.replace(args, max_seq_len=back.max_seq_len)
    Qwen3StateDictAdapter(args).check_hf_config(config)


def test_config_mismatches_are_named_field_by_field():
    config = to_hf_config(qwen3_flavors["30B-A3B"]) | {"num_experts": 64, "num_hidden_layers": 40}
    with pytest.raises(
        ValueError,
        match="^config.json has n_layers = 40 but model.flavor gives 48, "
        "moe.num_experts = 64 but model.flavor gives 128; ",
    ):
        Qwen3StateDictAdapter(qwen3_flavors["30B-A3B"]).check_hf_config(config)
    with pytest.raises(
        ValueError, match="describes \\['Qwen3ForCausalLM'\\], not Qwen3MoeForCausalLM"
    ):
        Qwen3StateDictAdapter(qwen3_flavors["30B-A3B"]).check_hf_config(
            to_hf_config(qwen3_flavors["8B"])
        )
    with pytest.raises(ValueError, match="config.json: sliding-window layers"):
        from_hf_config(to_hf_config(qwen3_flavors["8B"]) | {"use_sliding_window": True})


def test_aux_loss_free_flavors_do_not_export():
    args = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, load_balance_coeff=1e-3))
    with pytest.raises(ValueError, match="expert bias .* has no Hugging Face equivalent"):
        Qwen3StateDictAdapter(args).hf_config()


def test_initial_load_and_last_save_in_hf_go_through_the_adapter(case, tmp_path):
    """What ``checkpoint.initial_load_in_hf`` / ``last_save_in_hf`` run (one process here;
    the layouts are covered for every model by the Llama 3 and DeepSeek-V3 interop tests)."""
    from torchtitan.components.checkpointing.huggingface import load_hf_weights, save_hf_weights

    args, hf, _, folder = case
    loaded = our_model(args)
    load_hf_weights([loaded], folder, Qwen3StateDictAdapter(args))
    assert max_logit_error(loaded, hf, tokens()) < TOLERANCE
    save_hf_weights([loaded], tmp_path, Qwen3StateDictAdapter(args), torch.float32, None)
    on_disk, saved = (
        load_file(folder / "model.safetensors"),
        load_file(tmp_path / "model.safetensors"),
    )
    assert saved.keys() == on_disk.keys() and all(
        torch.equal(saved[k], on_disk[k]) for k in on_disk
    )
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    assert max_logit_error(loaded, reloaded.eval(), tokens()) < TOLERANCE
