"""Our gpt-oss against Hugging Face's ``GptOssForCausalLM``: a random tiny model (sliding and
full layers, a window shorter than the sequence, YaRN without rounding, biased router and
experts, a clamp that bites) loaded through our adapter gives the same logits in fp32 and
the same gradients; the export round-trips bit-exactly and runs in transformers; a
released-style MXFP4 folder loads through the hardened loader to transformers' logits for
that folder; planted errors (sinks ignored, window off by one, clamp removed) fail."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from torchtitan.components.checkpointing import mxfp4  # noqa: E402
from torchtitan.components.checkpointing.huggingface import load_hf_weights  # noqa: E402
from torchtitan.layers import moe as moe_layer  # noqa: E402
from torchtitan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe  # noqa: E402
from torchtitan.models.gpt_oss.flavors import gpt_oss_flavors  # noqa: E402
from torchtitan.models.gpt_oss.model import GptOssModel  # noqa: E402
from torchtitan.models.gpt_oss.state_dict_adapter import (  # noqa: E402
    GptOssStateDictAdapter,
    from_hf_config,
    to_hf_config,
)

VOCAB, SEQ_LEN, TOLERANCE = 96, 40, 1e-5
TINY = GptOssModelArgs(
    vocab_size=VOCAB,
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    attention_window=8,
    rope_factor=4.0,
    rope_original_seq_len=16,
    moe=dataclasses.replace(gpt_oss_moe(8, 4), swiglu_limit=0.3),
    moe_hidden_dim=32,
    max_seq_len=64,
)


def hf_config(args: GptOssModelArgs):
    fields = {
        k: v for k, v in to_hf_config(args).items() if k not in ("architectures", "model_type")
    }
    return transformers.GptOssConfig(**fields, initializer_range=0.1, attn_implementation="eager")


def hf_model(args: GptOssModelArgs = TINY):
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        model = transformers.GptOssForCausalLM(hf_config(args)).float().eval()
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # zero at init in transformers: make them matter
                param.normal_(0.0, 0.1)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)
    return model


def our_model(args: GptOssModelArgs, state_dict: dict | None = None) -> GptOssModel:
    with torch.device("meta"):
        model = GptOssModel(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_logit_error(ours: GptOssModel, hf, batch: torch.Tensor) -> float:
    return (ours(batch) - hf(batch).logits).abs().max().item()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    hf = hf_model()
    folder = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(folder)
    ours = our_model(
        TINY, GptOssStateDictAdapter(TINY).from_hf(load_file(folder / "model.safetensors"))
    )
    return hf, ours, folder


def test_same_logits_as_hugging_face(loaded):
    hf, ours, _ = loaded
    assert set(hf.config.layer_types) == {"sliding_attention", "full_attention"}
    with torch.no_grad():
        assert hf(tokens()).logits.std() > 0.3  # not trivially satisfied
    assert max_logit_error(ours, hf, tokens()) < TOLERANCE


def test_same_gradients_as_hugging_face(loaded):
    """Every parameter's gradient of the same loss, compared in Hugging Face's layout."""
    hf, ours, _ = loaded
    batch = tokens(seed=4)
    hf.zero_grad()
    ours.zero_grad()
    hf(batch).logits.log_softmax(-1)[..., 0].sum().backward()
    ours(batch).log_softmax(-1)[..., 0].sum().backward()
    ours_grads = GptOssStateDictAdapter(TINY).to_hf(
        {name: p.grad for name, p in ours.named_parameters()}
    )
    theirs = {name: p.grad for name, p in hf.named_parameters()}
    assert ours_grads.keys() == theirs.keys()
    for name, grad in theirs.items():
        assert grad.abs().max() > 0, name
        scale = grad.abs().max().item()  # fp32 sums in another order: relative to the tensor
        torch.testing.assert_close(ours_grads[name], grad, rtol=1e-4, atol=1e-6 * scale)


def test_export_round_trip_is_bit_exact_and_loads_in_transformers(loaded, tmp_path):
    _, ours, folder = loaded
    adapter = GptOssStateDictAdapter(TINY)
    on_disk = load_file(folder / "model.safetensors")
    exported = adapter.to_hf(ours.state_dict())
    assert exported.keys() == on_disk.keys()
    assert all(torch.equal(exported[k], on_disk[k]) for k in on_disk)
    again = adapter.from_hf(exported)
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())

    fresh = our_model(TINY)  # our own random weights, written as a checkpoint folder
    save_file(
        {k: v.contiguous() for k, v in adapter.to_hf(fresh.state_dict()).items()},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config() | {"dtype": "float32"}))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    assert type(theirs) is transformers.GptOssForCausalLM
    assert max_logit_error(fresh, theirs.eval(), tokens(seed=3)) < TOLERANCE


def test_mxfp4_folder_loads_to_transformers_logits(loaded, tmp_path):
    """A folder in the released layout (expert weights as ``*_blocks`` / ``*_scales``) loads
    through the hardened loader, bit-exact with transformers' dequantisation; the same
    folder's logits in transformers (dequantised on load) are ours."""
    hf, _, folder = loaded
    tensors = load_file(folder / "model.safetensors")
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        tensors[key + "_blocks"], tensors[key + "_scales"] = mxfp4.quantize(tensors.pop(key))
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    key = "model.layers.0.mlp.experts.gate_up_proj"
    blocks, scales = tensors[key + "_blocks"], tensors[key + "_scales"]
    ours_dense = mxfp4.dequantize(blocks, scales)
    theirs_dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours_dense, theirs_dense)
    assert torch.equal(ours_dense.bfloat16(), convert_moe_packed_tensors(blocks, scales))
    assert (ours_dense - load_file(folder / "model.safetensors")[key]).abs().max() > 0  # lossy

    model = our_model(TINY)
    load_hf_weights([model], tmp_path, GptOssStateDictAdapter(TINY))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        attn_implementation="eager",
        dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
    ).eval()
    assert max_logit_error(model, theirs, tokens(seed=5)) < TOLERANCE


@pytest.mark.parametrize("planted", ["sinks ignored", "window off by one", "clamp removed"])
def test_planted_errors_fail_the_comparison(loaded, planted):
    hf, ours, _ = loaded
    state = ours.state_dict()
    if planted == "window off by one":
        model = our_model(dataclasses.replace(TINY, attention_window=7), state)
    else:
        model = our_model(TINY, state)
        for block in model.layers.values():
            if planted == "sinks ignored":
                block.attention.sinks = None
            else:
                block.moe.experts.activation = functools.partial(
                    moe_layer._clamped_glu, limit=math.inf, alpha=TINY.moe.swiglu_alpha
                )
    assert max_logit_error(model, hf, tokens()) > 1e-3


def test_config_json_round_trip_and_published_parameter_counts():
    """Our 20B / 120B flavors as config.json build transformers models of the published
    sizes (20,914,757,184 and 116,829,156,672 parameters), and read back as the flavors."""
    counts = {}
    for name, published in (("20B", 20_914_757_184), ("120B", 116_829_156_672)):
        args = gpt_oss_flavors[name]
        with torch.device("meta"):
            ours = sum(p.numel() for p in GptOssModel(args).parameters())
            theirs = sum(
                p.numel() for p in transformers.GptOssForCausalLM(hf_config(args)).parameters()
            )
        counts[name] = ours
        assert ours == theirs == published, (name, ours, theirs)
        back = from_hf_config(to_hf_config(args))
        assert (back.layer_types, back.attention_window, back.moe.num_experts) == (
            args.layer_types,
            args.attention_window,
            args.moe.num_experts,
        )
    print(f"gpt-oss parameters: {counts}")
