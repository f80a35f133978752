"""The hf model backend (``model.name = "hf"``) against transformers: logits of tiny random
configs of many architectures (transformers' own model, eager attention, loaded with our
weights), sliding windows and packed documents through our attention seam, initialisation by
FQN, and one clear line for folders it cannot build."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from scripts.hf_compat import build_model as build
from scripts.hf_compat import transformers_model as reference
from scripts.hf_compat import write_folder
from torchtitan.config import ConfigError

DENSE = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma3_text",
    "phi3",
    "olmo2",
    "olmo3",
    "smollm3",
    "glm4",
    "starcoder2",
    "stablelm",
    "granite",
    "helium",
    "exaone4",
]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "phimoe", "gpt_oss"]


@pytest.mark.parametrize("model_type", DENSE + MOE)
def test_logits_equal_transformers(model_type, tmp_path):
    folder = write_folder(tmp_path, model_type)
    model = build(folder)
    tokens = torch.randint(3, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(folder, model)(tokens).logits
    assert ours.std() > 0.05  # initialised, not zeros
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "model_type, fields",
    [
        ("cohere", {}),  # logit_scale 0.0625 multiplies
        ("granite", {"logits_scaling": 8.0}),  # divides the logits
        ("minicpm3", {"dim_model_base": 16}),  # divides the hidden states by 64 / 16
        ("nanochat", {"final_logit_softcapping": 2.0}),  # tanh(logits / 2) * 2
    ],
)
def test_scaled_and_soft_capped_logits_equal_transformers(model_type, fields, tmp_path):
    """Logits scaled or soft-capped after the decoder equal transformers'; leaving the
    scale or the cap out (a planted error) does not. A soft-capped model takes the full
    logits: the chunked loss is refused in one line when asked for."""
    from torchtitan.components.training_loss import chunked_loss_for
    from torchtitan.config import TrainingConfig
    from torchtitan.protocols.train_spec import get_train_spec

    folder = write_folder(tmp_path, model_type, **fields)
    model = build(folder)
    tokens = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = reference(folder, model)(tokens).logits
        torch.testing.assert_close(model(tokens), theirs, rtol=0, atol=1e-5)
        model.logit_scale, model.logit_softcap = 1.0, None
        assert (model(tokens) - theirs).abs().max() > 1e-2
    if model.needs_full_logits:
        with pytest.raises(ConfigError, match=r"^training.loss_chunk_size=64: the model soft"):
            chunked_loss_for(
                TrainingConfig(loss_chunk_size=64), get_train_spec("hf"), model, "cpu", 1
            )


def test_a_sliding_window_layer_masks_as_transformers_does(tmp_path):
    """Gemma 3 alternates sliding-window (8 tokens here) and full attention; 40 tokens."""
    folder = write_folder(
        tmp_path,
        "gemma3_text",
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = build(folder)
    tokens = torch.randint(3, 320, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens), reference(folder, model)(tokens).logits, rtol=0, atol=1e-5
        )


def test_packed_documents_see_only_themselves(tmp_path):
    """block_causal: each of two packed documents (positions restarting) gives the logits of
    that document run alone through transformers; plain causal attention (a planted error)
    does not."""
    folder = write_folder(tmp_path, "qwen3")
    packed = build(folder, "--model.attn_type", "flex", "--model.attn_mask_type", "block_causal")
    ref = reference(folder, packed)
    first, second = torch.randint(3, 320, (1, 24)), torch.randint(3, 320, (1, 16))
    tokens = torch.cat([first, second], dim=1)
    document_ids = torch.tensor([[0] * 24 + [1] * 16])
    positions = torch.cat([torch.arange(24), torch.arange(16)]).unsqueeze(0)
    with torch.no_grad():
        ours = packed(tokens, positions, document_ids)
        alone = torch.cat([ref(first).logits, ref(second).logits], dim=1)
        torch.testing.assert_close(ours, alone, rtol=0, atol=1e-5)
        causal = build(folder)
        assert not torch.allclose(causal(tokens, positions), alone, atol=1e-3)


def test_initialisation_follows_the_seed_and_fqn_not_the_build(tmp_path):
    folder = write_folder(tmp_path, "llama")
    first, again, other = build(folder), build(folder), build(folder, seed=1)
    for (name, a), b, c in zip(
        first.state_dict().items(), again.state_dict().values(), other.state_dict().values()
    ):
        assert torch.equal(a, b), name
        if "norm" not in name:
            assert not torch.equal(a, c), name
    q = first.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - 0.02) < 0.002  # transformers' initializer_range


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c.update(model_type="no_such_model"),
            "model_type 'no_such_model' is not a model of",
        ),
        (
            lambda c: c.update(model_type="nope", auto_map={"AutoModelForCausalLM": "x.Y"}),
            "names remote code, which is never run",
        ),
        (lambda c: c.update(attn_logit_softcapping=50.0), "sets attn_logit_softcapping"),
        (
            lambda c: c.update(rope_parameters=[1, 2]),
            "config.json is not a valid llama config",
        ),
    ],
)
def test_a_folder_the_backend_cannot_build_is_one_line(edit, message, tmp_path):
    folder = write_folder(tmp_path, "gemma2" if "softcapping" in message else "llama")
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as error:
        build(folder)
    assert "\n" not in str(error.value)


def test_a_missing_folder_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.hf_assets_path: .*config.json does not exist"):
        build(tmp_path / "absent")


def test_lora_adapters_export_as_a_peft_adapter_that_computes_alike(tmp_path):
    """LoRA on the hf backend (transformers' module names as targets, lm_head too): the
    adapters, made non-zero, export as a PEFT folder that PEFT loads onto transformers' model
    of the same base, with our logits; the base alone (the adapters dropped) differs."""
    from scripts.hf_compat import lora_check

    lora_check(write_folder(tmp_path, "qwen3"), tmp_path)


def test_parameters_init_weights_leaves_unset_take_their_constructor_values(tmp_path):
    """Apertus's xIELU coefficients (parameters and buffers) are set by its constructor only:
    two builds agree, with the constructor's values (not uninitialised memory)."""
    from transformers.activations import XIELUActivation

    first, second = (build(write_folder(tmp_path, "apertus")) for _ in range(2))
    fresh = XIELUActivation()
    activation = first.layers[1].mlp.act_fn
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        torch.testing.assert_close(getattr(activation, name), getattr(fresh, name).float())
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_greedy_generation_equals_transformers_with_and_without_the_kv_cache(tmp_path):
    """Our generation (the KV cache plugs into the attention seam) gives transformers' own
    greedy tokens."""
    from torchtitan.generation import generate

    folder = write_folder(tmp_path, "qwen3")
    model = build(folder)
    prompt = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    kwargs = {"max_new_tokens": 8, "temperature": 0.0, "seed": 3}
    cached = generate(model, prompt, use_kv_cache=True, **kwargs)
    assert torch.equal(cached, generate(model, prompt, use_kv_cache=False, **kwargs))
    theirs = reference(folder, model).generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(cached, theirs)


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_model_keeps_its_embedding_out_of_the_tensor_parallel_plan(tied, tmp_path):
    """LFM2's plan splits the embedding by vocabulary rows; tied, the same weight is also
    lm_head (not split alike), so the embedding stays whole (TP 2 then equals 1 process:
    hf_compat's table)."""
    from torchtitan.models.hf.parallelize import tp_plan

    model = build(write_folder(tmp_path, "lfm2", tie_word_embeddings=tied))
    assert ("embed_tokens" in tp_plan(model)) is not tied


@pytest.mark.parametrize("model_type", ["lfm2", "olmo_hybrid", "minimax", "llama"])
def test_context_parallel_refuses_layers_that_mix_tokens_without_attention(model_type, tmp_path):
    """LFM2's convolution layers, OLMo-Hybrid's linear-attention layers and MiniMax's
    lightning attention (an ``...Attention`` class that computes without the attention
    registry) would each see only their rank's piece of the sequence under CP; Llama's
    attention-only layers pass."""
    from torchtitan.models.hf.parallelize import check_context_parallel

    kinds = {"lfm2": {"layer_types": ["conv", "full_attention"]}}  # its tiny default: attention
    model = build(write_folder(tmp_path, model_type, **kinds.get(model_type, {})))
    if model_type == "llama":
        check_context_parallel(model)
        return
    with pytest.raises(ConfigError, match="mixes tokens without attention") as error:
        check_context_parallel(model)
    assert str(error.value).startswith("parallelism.context_parallel_degree:")


def test_a_model_without_a_plan_gets_one_from_its_projection_names_or_one_line(tmp_path):
    """StableLM ships no plan: its q/k/v/gate/up projections split by columns, o/down by
    rows (TP 2 then equals 1 process: hf_compat's table); BitNet's norm between the
    projections would see half the features, so its TP is refused in one line."""
    from torchtitan.models.hf.parallelize import derived_plan

    plan = derived_plan(build(write_folder(tmp_path, "stablelm")))
    assert plan == {
        **{f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    with pytest.raises(ConfigError, match=r"^parallelism.tensor_parallel_degree: .*attn_sub_norm"):
        derived_plan(build(write_folder(tmp_path, "bitnet")))


def test_bare_parameters_split_by_heads_or_are_refused_in_one_line(tmp_path, monkeypatch):
    """Granite SWA's plan splits each attention's sinks (one per head) by name; a style
    other than colwise on a bare parameter is refused in one line."""
    from torchtitan.models.hf.parallelize import bare_parameters

    model = build(write_folder(tmp_path, "granite_swa"))
    found = bare_parameters(model)
    assert [name for _, name in found] == ["sinks"] * len(model.layers)
    text = model.model_args.hf_config.get_text_config()
    monkeypatch.setitem(text.base_model_tp_plan, "layers.*.self_attn.sinks", "rowwise")
    with pytest.raises(ConfigError, match=r"^parallelism.tensor_parallel_degree: .*sinks as 'row"):
        bare_parameters(model)


def test_a_config_asking_for_the_router_loss_is_told_it_is_not_added(tmp_path, caplog):
    from torchtitan.models.hf.args import load_hf_config

    folder = write_folder(tmp_path, "mixtral", output_router_logits=True)
    with caplog.at_level("WARNING", logger="torchtitan"):
        load_hf_config(str(folder))
    assert "does not add transformers' load-balancing loss (router_aux_loss_coef" in caplog.text


def test_pipeline_stages_drop_the_embedding_and_final_norm_under_the_models_own_names(tmp_path):
    """GPT-NeoX calls them embed_in and final_layer_norm: a middle stage drops both (before,
    its first stage kept the final norm and normalised twice); DeepSeek V4's base also runs a
    hyper-connection head and nanochat's applies its final norm before the layers too, so
    splitting either is refused in one line."""
    model = build(write_folder(tmp_path, "gpt_neox"))
    assert model.tok_embeddings is model.base.embed_in
    assert model.norm is model.base.final_layer_norm
    model.tok_embeddings, model.norm = None, None
    assert model.base.embed_in is None and isinstance(model.base.final_layer_norm, nn.Identity)
    with pytest.raises(ConfigError, match=r"^parallelism.pipeline_parallel_degree: .*hc_head"):
        build(write_folder(tmp_path, "deepseek_v4")).norm = None
    with pytest.raises(ConfigError, match="also before the decoder layers"):
        build(write_folder(tmp_path, "nanochat")).norm = None


def test_the_compat_tables_logits_check_catches_a_planted_error(tmp_path, monkeypatch):
    """hf_compat's logits column (logits and every gradient vs transformers) passes for
    Qwen3 and fails once our model's MLP activation is swapped (GELU for SiLU)."""
    import scripts.hf_compat as compat

    folder = write_folder(tmp_path, "qwen3")
    compat.logits_check(folder)

    def planted(*args, **kwargs):
        model = build(*args, **kwargs)
        model.layers[1].mlp.act_fn = nn.GELU()
        return model

    monkeypatch.setattr(compat, "build_model", planted)
    with pytest.raises(AssertionError):
        compat.logits_check(folder)


def test_a_model_that_computes_its_own_attention_mask_is_refused_in_one_line(tmp_path):
    """Doge's dynamic mask reaches the attention function, where our kernels would drop it
    (before: logits matched at initialisation, gradients did not)."""
    model = build(write_folder(tmp_path, "doge"))
    with pytest.raises(ConfigError, match=r"^model.hf_assets_path: DogeAttention computes its own"):
        model(torch.randint(3, 300, (1, 16)))
