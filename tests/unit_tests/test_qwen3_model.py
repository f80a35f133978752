"""Qwen3 flavors (published sizes), tied embeddings, and the layout checks that run before
any process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.layers.moe import GroupedExperts
from torchtitan.models.qwen3.flavors import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.preflight import preflight

# Published totals, activated parameters (MoE) and non-embedding parameters (without the
# embedding and the output layer), in billions, as the model cards give them.
PUBLISHED = {
    "0.6B": (0.6, 0.6, 0.44),
    "1.7B": (1.7, 1.7, 1.4),
    "4B": (4.0, 4.0, 3.6),
    "8B": (8.2, 8.2, 6.95),
    "14B": (14.8, 14.8, 13.2),
    "32B": (32.8, 32.8, 31.2),
    "30B-A3B": (30.5, 3.3, 29.9),
    "235B-A22B": (235.0, 22.0, 234.0),
}


def meta_model(flavor: str) -> Qwen3Model:
    with torch.device("meta"):
        return Qwen3Model(qwen3_flavors[flavor])


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_flavors_have_the_published_size(flavor):
    args, model = qwen3_flavors[flavor], meta_model(flavor)
    total, _ = args.get_nparams_and_flops(model, 4096)
    routed = sum(
        p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    )
    active = total - (routed * (1 - args.moe.top_k / args.moe.num_experts) if args.moe else 0)
    vocab_weights = args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)
    non_embedding = total - vocab_weights
    print(
        f"qwen3 {flavor}: {total:,} parameters ({active / 1e9:.2f}B active, "
        f"{non_embedding / 1e9:.2f}B non-embedding)"
    )
    published_total, published_active, published_non_embedding = PUBLISHED[flavor]
    for ours, published in (
        (total, published_total),
        (active, published_active),
        (non_embedding, published_non_embedding),
    ):
        assert ours / 1e9 == pytest.approx(published, rel=0.02)  # the cards' rounding


def test_tied_embeddings_stay_one_parameter():
    args = dataclasses.replace(
        qwen3_flavors["debugmodel"], tie_word_embeddings=True, max_seq_len=32
    )
    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device="cpu")  # moving across devices gives each module a copy: tied again
    model.init_weights(seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())
    model(torch.randint(0, args.vocab_size, (2, 8))).sum().backward()
    assert model.tok_embeddings.weight.grad is not None
    assert model.tok_embeddings.weight.std().item() == pytest.approx(args.dim**-0.5, rel=0.15)


def check(world_size: int, flavor: str, *args: str):
    config = ConfigManager().parse_args(
        ["--model.name", "qwen3", "--model.flavor", flavor, "--training.seq_len", "64", *args]
    )
    return preflight(config, world_size, "cpu")


def test_expert_parallel_layout_is_accepted():
    dims = check(
        4,
        "debugmodel_moe",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.expert_tensor_parallel_degree",
        "2",
    )
    assert (dims.dp_shard, dims.ep, dims.etp) == (2, 2, 2)


@pytest.mark.parametrize(
    "world, flavor, args, message",
    [
        (
            6,
            "debugmodel_moe",
            ["--parallelism.expert_parallel_degree", "3"],
            "expert_parallel_degree (3) must divide the model's number of routed experts (8)",
        ),
        (
            2,
            "debugmodel",
            ["--parallelism.expert_parallel_degree", "2"],
            "qwen3 flavor (dense) has no experts",
        ),
        (
            8,
            "debugmodel",
            ["--parallelism.tensor_parallel_degree", "8"],
            "must divide the model's n_kv_heads (4)",
        ),
        (
            2,
            "0.6B",
            ["--parallelism.pipeline_parallel_degree", "2"],
            "pipeline_parallel_degree: this qwen3 flavor ties the output layer to the embedding",
        ),
    ],
)
def test_impossible_layouts_give_one_line(world, flavor, args, message):
    with pytest.raises(ConfigError) as e:
        check(world, flavor, *args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_tensor_parallel_and_fsdp_keep_tied_embeddings_tied(fake_rank1_of_2):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from torchtitan.models.common.parallelize import apply_tp

    args = dataclasses.replace(
        qwen3_flavors["debugmodel"], tie_word_embeddings=True, max_seq_len=32
    )
    with torch.device("meta"):
        model = Qwen3Model(args)
    apply_tp(model, fake_rank1_of_2, loss_parallel=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.placements == (Shard(0),)
    q_norm = model.layers["0"].attention.q_norm.weight  # replicated, gradient summed over tp
    assert type(q_norm).__name__ == "DTensor"

    with torch.device("meta"):
        model = Qwen3Model(args)
    fully_shard(model, mesh=fake_rank1_of_2)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    assert model.output.weight is model.tok_embeddings.weight
