"""Our DeepSeek-V3 against Hugging Face's ``DeepseekV3ForCausalLM``: same weights (loaded
through our state-dict adapter) -> same logits in fp32. Covers MLA with and without the
low-rank query, interleaved RoPE with and without YaRN (softmax scale included), sigmoid
routing with the score-correction bias, group-limited routing, top-k normalisation, the
routed scaling factor and shared experts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from torchtitan.layers.moe import MoEArgs  # noqa: E402
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs  # noqa: E402
from torchtitan.models.deepseek_v3.flavors import deepseek_v3_flavors  # noqa: E402
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model  # noqa: E402
from torchtitan.models.deepseek_v3.state_dict_adapter import (  # noqa: E402
    DeepSeekV3StateDictAdapter,
    from_hf_config,
    to_hf_config,
)

VOCAB, SEQ_LEN, TOLERANCE = 96, 40, 1e-5

PLAIN = DeepSeekV3ModelArgs(
    vocab_size=VOCAB,
    dim=48,
    inter_dim=80,
    moe_inter_dim=24,
    n_layers=3,
    n_dense_layers=1,
    n_heads=4,
    moe=MoEArgs(num_experts=8, num_shared_experts=1, top_k=2, score_func="sigmoid"),
    q_latent_rank=0,
    kv_latent_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_seq_len=64,
)
# Low-rank queries, YaRN over a 16-token original context (so every frequency band is
# touched within SEQ_LEN), 4 groups of which 2 are kept, normalised and scaled weights.
FULL = dataclasses.replace(
    PLAIN,
    n_layers=4,
    n_dense_layers=2,
    q_latent_rank=24,
    rope_factor=4.0,
    rope_original_seq_len=16,
    rope_mscale=0.707,
    moe=MoEArgs(
        num_experts=8,
        num_shared_experts=2,
        top_k=3,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        num_expert_groups=4,
        num_limited_groups=2,
    ),
)


def hf_model(args: DeepSeekV3ModelArgs) -> transformers.DeepseekV3ForCausalLM:
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in to_hf_config(args).items() if k not in ("architectures", "model_type")},
        initializer_range=0.1,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        model = transformers.DeepseekV3ForCausalLM(config).float().eval()
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.05)
    return model


def our_model(args: DeepSeekV3ModelArgs, state_dict: dict) -> DeepSeekV3Model:
    model = DeepSeekV3Model(args)
    model.init_weights(seed=0)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


@pytest.mark.parametrize("args", [PLAIN, FULL], ids=["plain", "lowrank_q_yarn_groups"])
def test_same_logits_as_hugging_face(args, tmp_path):
    hf = hf_model(args)
    hf.save_pretrained(tmp_path)  # the published per-expert layout
    adapter = DeepSeekV3StateDictAdapter(args)
    ours = our_model(args, adapter.from_hf(load_file(tmp_path / "model.safetensors")))
    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert (got - expected).abs().max().item() < TOLERANCE


def test_adapter_round_trips_and_reads_the_fused_in_memory_layout(tmp_path):
    hf = hf_model(FULL)
    hf.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    adapter = DeepSeekV3StateDictAdapter(FULL)
    ours = adapter.from_hf(on_disk)
    back = adapter.to_hf(ours)
    assert back.keys() == on_disk.keys()
    assert all(torch.equal(back[k], on_disk[k]) for k in on_disk)
    fused = adapter.from_hf(hf.state_dict())
    assert fused.keys() == ours.keys()
    assert all(torch.equal(fused[k], ours[k]) for k in ours)


def test_adapter_rejects_unknown_keys_and_missing_experts():
    adapter = DeepSeekV3StateDictAdapter(PLAIN)
    with pytest.raises(ValueError, match="unknown Hugging Face DeepSeek-V3 key"):
        adapter.from_hf({"model.layers.0.mlp.weight_scale_inv": torch.zeros(1)})
    with pytest.raises(ValueError, match="expected experts 0..7"):
        adapter.from_hf({"model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(2, 2)})


@pytest.mark.parametrize(
    "args",
    [PLAIN, FULL, deepseek_v3_flavors["671B"]],
    ids=["plain", "lowrank_q_yarn_groups", "671B"],
)
def test_config_round_trips_through_transformers(args):
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in to_hf_config(args).items() if k not in ("architectures", "model_type")}
    ).to_dict()
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    back = from_hf_config(config)
    back.max_seq_len = args.max_seq_len
    assert back == args
    DeepSeekV3StateDictAdapter(args).check_hf_config(config)


def test_published_config_form_is_understood():
    """The 671B checkpoint's config.json spells RoPE the transformers 4.x way."""
    args = deepseek_v3_flavors["671B"]
    config = {k: v for k, v in to_hf_config(args).items() if k != "rope_parameters"}
    config.update(
        rope_theta=10000,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
    )
    DeepSeekV3StateDictAdapter(args).check_hf_config(config)
    config["num_hidden_layers"] = 60
    with pytest.raises(
        ValueError, match="^config.json has n_layers = 60 but model.flavor gives 61; "
    ):
        DeepSeekV3StateDictAdapter(args).check_hf_config(config)


def test_softmax_routing_has_no_hugging_face_config():
    adapter = DeepSeekV3StateDictAdapter(deepseek_v3_flavors["16B"])
    with pytest.raises(ValueError, match="routes with softmax scores .* only routes with sigmoid"):
        adapter.hf_config()
