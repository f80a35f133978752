"""What the models' arguments share: parameter and FLOP counts, and the layout checks that
run before any process group (each failure one ``ConfigError`` line naming the knob)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.layers.moe import GroupedExperts, MoEArgs

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims


def nparams_and_flops(
    model: nn.Module,
    attention_flops: int,
    moe: MoEArgs | None = None,
    tied_embeddings: bool = False,
) -> tuple[int, int]:
    """Parameter count and training FLOPs per token (works on meta models).

    Every weight used in matmuls costs 6 FLOPs per token (forward + backward): all but the
    embedding table (a lookup; with tied embeddings it is also the output matmul, so it
    counts) and, of the routed experts, the ``1 - top_k / num_experts`` a token does not
    reach. ``attention_flops``: the scores and their application per token."""
    nparams = sum(p.numel() for p in model.parameters())
    embedding = (
        0
        if tied_embeddings
        else sum(
            p.numel()
            for m in model.modules()
            if isinstance(m, nn.Embedding)
            for p in m.parameters()
        )
    )
    inactive = 0.0
    if moe is not None:
        routed = sum(
            p.numel()
            for m in model.modules()
            if isinstance(m, GroupedExperts)
            for p in m.parameters()
        )
        inactive = routed * (1 - moe.top_k / moe.num_experts)
    return nparams, int(6 * (nparams - embedding - inactive) + attention_flops)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_tp_divides_heads(tp: int, **heads: int) -> None:
    """Tensor parallel shards attention heads: ``tp`` must divide every head count."""
    for name, count in heads.items():
        require(
            count % tp == 0,
            f"parallelism.tensor_parallel_degree ({tp}) must divide the model's "
            f"{name} ({count}); choose a tensor_parallel_degree that divides it",
        )


def check_no_experts(parallel_dims: ParallelDims, model: str) -> None:
    require(
        parallel_dims.ep == 1 and parallel_dims.etp == 1,
        "parallelism.expert_parallel_degree / expert_tensor_parallel_degree: "
        f"{model} has no experts; leave them at 1 (or train a MoE model)",
    )


def check_expert_layout(
    parallel_dims: ParallelDims, moe: MoEArgs, hidden_sizes: dict[str, int]
) -> None:
    """Expert parallel shards the routed experts, expert-tensor parallel their hidden sizes."""
    ep, etp = parallel_dims.ep, parallel_dims.etp
    require(
        moe.num_experts % ep == 0,
        f"parallelism.expert_parallel_degree ({ep}) must divide the "
        f"model's number of routed experts ({moe.num_experts})",
    )
    if etp > 1:
        sizes = ", ".join(f"{name} {size}" for name, size in hidden_sizes.items())
        require(
            all(size % etp == 0 for size in hidden_sizes.values()),
            f"parallelism.expert_tensor_parallel_degree ({etp}) must divide the experts' "
            f"hidden sizes ({sizes})",
        )
