"""Our Qwen3.5 against transformers' ``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM``:
random tiny models (Gated DeltaNet and gated attention layers, a sequence several delta-rule
chunks long, partial RoPE) loaded through our adapter give the same logits in fp32 and the
same gradients; the export round-trips bit-exactly and runs in transformers; a multimodal
checkpoint's language model loads with its vision tower skipped; planted errors (convolution
tail dropped, decay sign flipped, output gate skipped) fail; packed documents under
block_causal give each document's own logits and gradients; the published shapes' parameter
counts equal transformers'."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from torchtitan.components.checkpointing.huggingface import load_hf_weights  # noqa: E402
from torchtitan.layers import gated_deltanet  # noqa: E402
from torchtitan.models.qwen3_5.args import DELTA_RULE, FULL, Qwen3_5ModelArgs, qwen3_5_moe  # noqa: E402
from torchtitan.models.qwen3_5.flavors import qwen3_5_flavors  # noqa: E402
from torchtitan.models.qwen3_5.model import Qwen3_5Model  # noqa: E402
from torchtitan.models.qwen3_5.state_dict_adapter import (  # noqa: E402
    Qwen3_5StateDictAdapter,
    from_hf_config,
    to_hf_config,
)

VOCAB, SEQ_LEN, TOLERANCE = 96, 40, 1e-5
DENSE = Qwen3_5ModelArgs(
    vocab_size=VOCAB,
    dim=64,
    n_layers=4,
    layer_types=[DELTA_RULE, FULL, DELTA_RULE, FULL],
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    delta_rule_n_k_heads=2,
    delta_rule_n_v_heads=4,
    delta_rule_k_head_dim=8,
    delta_rule_v_head_dim=12,
    delta_rule_chunk_size=16,
    ffn_hidden_dim=96,
    max_seq_len=64,
)
MOE = dataclasses.replace(
    DENSE, moe=qwen3_5_moe(8, 2), moe_hidden_dim=32, shared_expert_hidden_dim=48
)
CASES = {"dense": DENSE, "moe": MOE}


def hf_config(args: Qwen3_5ModelArgs):
    fields = {
        k: v for k, v in to_hf_config(args).items() if k not in ("architectures", "model_type")
    }
    config_cls = (
        transformers.Qwen3_5TextConfig if args.moe is None else transformers.Qwen3_5MoeTextConfig
    )
    return config_cls(**fields, attn_implementation="eager")


def hf_class(args: Qwen3_5ModelArgs):
    return (
        transformers.Qwen3_5ForCausalLM if args.moe is None else transformers.Qwen3_5MoeForCausalLM
    )


def hf_model(args: Qwen3_5ModelArgs):
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        model = hf_class(args)(hf_config(args)).float().eval()
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                # decay rates 0.05 .. 0.37 per token: memories that span several chunks, so
                # the state carried across chunks matters (rates near e, as U(-1, 1) gives,
                # forget within a chunk and magnify fp32 rounding to ~2e-5 of the logits)
                param.uniform_(-3.0, -1.0)
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif "norm" in name:  # zero-centred: the scale is 1 + weight
                param.uniform_(-0.5, 0.5)
            elif "conv1d" in name:
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.1)
    return model


def our_model(args: Qwen3_5ModelArgs, state_dict: dict | None = None) -> Qwen3_5Model:
    with torch.device("meta"):
        model = Qwen3_5Model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_logit_error(ours: Qwen3_5Model, hf, batch: torch.Tensor) -> float:
    return (ours(batch) - hf(batch).logits).abs().max().item()


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, tmp_path_factory):
    args = CASES[request.param]
    hf = hf_model(args)
    folder = tmp_path_factory.mktemp(f"qwen3_5_{request.param}")
    hf.save_pretrained(folder)
    adapter = Qwen3_5StateDictAdapter(args)
    ours = our_model(args, adapter.from_hf(load_file(folder / "model.safetensors")))
    return args, hf, ours, folder


def test_same_logits_as_transformers(loaded):
    args, hf, ours, _ = loaded
    assert (
        set(hf.config.layer_types) == {DELTA_RULE, FULL}
        and SEQ_LEN > 2 * args.delta_rule_chunk_size
    )
    with torch.no_grad():
        assert hf(tokens()).logits.std() > 0.3  # not trivially satisfied
    assert max_logit_error(ours, hf, tokens()) < TOLERANCE


def test_same_gradients_as_transformers(loaded):
    """Every parameter's gradient of the same loss, compared in our layout (transformers holds
    the experts fused in memory)."""
    args, hf, ours, _ = loaded
    batch = tokens(seed=4)
    hf.zero_grad()
    ours.zero_grad()
    hf(batch).logits.log_softmax(-1)[..., 0].sum().backward()
    ours(batch).log_softmax(-1)[..., 0].sum().backward()
    ours_grads = {name: p.grad for name, p in ours.named_parameters()}
    theirs = Qwen3_5StateDictAdapter(args).from_hf(
        {name: p.grad for name, p in hf.named_parameters()}
    )
    assert ours_grads.keys() == theirs.keys()
    for name, grad in theirs.items():
        assert grad.abs().max() > 0, name
        scale = grad.abs().max().item()  # fp32 sums in another order: relative to the tensor
        torch.testing.assert_close(ours_grads[name], grad, rtol=1e-4, atol=1e-5 * scale)


def test_export_round_trip_is_bit_exact_and_loads_in_transformers(loaded, tmp_path):
    args, _, ours, folder = loaded
    adapter = Qwen3_5StateDictAdapter(args)
    on_disk = load_file(folder / "model.safetensors")
    exported = adapter.to_hf(ours.state_dict())
    assert exported.keys() == on_disk.keys()
    assert all(torch.equal(exported[k], on_disk[k]) for k in on_disk)
    again = adapter.from_hf(exported)
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())

    fresh = our_model(args)  # our own random weights, written as a checkpoint folder
    save_file(
        {k: v.contiguous() for k, v in adapter.to_hf(fresh.state_dict()).items()},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config() | {"dtype": "float32"}))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    assert type(theirs) is hf_class(args)
    assert max_logit_error(fresh, theirs.eval(), tokens(seed=3)) < TOLERANCE


def test_multimodal_checkpoint_loads_its_language_model(loaded, tmp_path, caplog):
    """The published layout: ``model.language_model.*`` keys beside a vision tower, the
    config under ``text_config``; the tower is skipped with one warning line."""
    args, hf, _, folder = loaded
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in load_file(folder / "model.safetensors").items()
    }
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(6, 2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    family = "Qwen3_5" if args.moe is None else "Qwen3_5Moe"
    config = {
        "architectures": [f"{family}ForConditionalGeneration"],
        "text_config": to_hf_config(args),
        "vision_config": {"depth": 1},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = our_model(args)
    with caplog.at_level(logging.WARNING):
        load_hf_weights([model], tmp_path, Qwen3_5StateDictAdapter(args))
    warnings = [r for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(warnings) == 1
    assert max_logit_error(model, hf, tokens(seed=6)) < TOLERANCE


@pytest.mark.parametrize("planted", ["conv tail dropped", "decay sign flipped", "gate skipped"])
def test_planted_errors_fail_the_comparison(loaded, planted, monkeypatch):
    args, hf, ours, _ = loaded
    model = our_model(args, ours.state_dict())
    mixers = [
        b.attention
        for b in model.layers.values()
        if isinstance(b.attention, gated_deltanet.GatedDeltaNet)
    ]
    if planted == "conv tail dropped":
        with torch.no_grad():
            for mixer in mixers:
                for weight in (mixer.q_conv, mixer.k_conv, mixer.v_conv):
                    weight[:, :-1] = 0
    elif planted == "decay sign flipped":
        rule = gated_deltanet.chunk_gated_delta_rule
        monkeypatch.setattr(
            gated_deltanet,
            "chunk_gated_delta_rule",
            lambda q, k, v, g, beta, *a, **kw: rule(q, k, v, -g, beta, *a, **kw),
        )
    else:
        for mixer in mixers:
            monkeypatch.setattr(mixer, "gate_output", lambda normed, z: normed)
    assert not max_logit_error(model, hf, tokens()) < 1e-3  # a non-finite error fails too


@pytest.mark.parametrize("case", list(CASES))
def test_packed_documents_give_each_document_alone(case):
    """block_causal on FlexAttention and Gated DeltaNet: three documents (boundaries inside
    and between delta-rule chunks) give the logits and input gradients of each alone."""
    args = dataclasses.replace(CASES[case], attn_type="flex", attn_mask_type="block_causal")
    model = our_model(args)
    lengths, starts = [13, 20, 7], [0, 13, 33]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1)
    batch = tokens(seed=7)
    hidden = model.tok_embeddings(batch).detach().requires_grad_()
    embeddings, model.tok_embeddings = model.tok_embeddings, None
    weights = torch.linspace(-1, 1, VOCAB)
    packed = model(hidden, document_ids=document_ids)
    (packed * weights).sum().backward()
    alone_hidden = hidden.detach().clone().requires_grad_()
    total = 0
    for start, n in zip(starts, lengths):
        alone = model(alone_hidden[:, start : start + n])
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
        total = total + (alone * weights).sum()
    total.backward()
    torch.testing.assert_close(hidden.grad, alone_hidden.grad, rtol=1e-4, atol=1e-6)
    model.tok_embeddings = embeddings


def test_config_json_round_trip_and_published_parameter_counts():
    """The 9B and 35B-A3B flavors as config.json build transformers models of as many
    parameters as ours, and read back as the flavors."""
    counts = {}
    for name in ("9B", "35B-A3B"):
        args = qwen3_5_flavors[name]
        with torch.device("meta"):
            ours = sum(p.numel() for p in Qwen3_5Model(args).parameters())
            theirs = sum(p.numel() for p in hf_class(args)(hf_config(args)).parameters())
        counts[name] = ours
        assert ours == theirs, (name, ours, theirs)
        back = from_hf_config(to_hf_config(args))
        assert dataclasses.asdict(back) == dataclasses.asdict(args)
    print(f"Qwen3.5 text parameters: {counts}")
