"""Expert parallel (EP), expert tensor parallel (ETP) and tensor parallel inside MoE layers.

Per MoE layer (``torchtitan.layers.moe.MoE``):

- Routed experts: weights ``Shard(0)`` over ``world_mesh["ep"]`` (each EP rank holds
  ``num_experts / ep`` experts); with ETP also sharded over ``tp`` (``w1``/``w3`` on their
  hidden rows, ``w2`` on its hidden columns). Tokens reach their experts by an all-to-all
  of per-expert counts, then of the tokens (dispatch), are reordered from (source rank,
  expert) to (expert, source rank) order, and return by the reverse all-to-all (combine).
- Under TP the MoE input is all-gathered over ``tp`` so every TP rank routes the same
  tokens; the router is replicated. With ETP the routed and shared experts' outputs are
  partial sums over ``tp`` (reduce-scattered back to sequence shards); without ETP the
  experts are replicated over ``tp`` and compute redundantly.
- Experts get FSDP over ``world_mesh["efsdp"]``, the rest of the block over
  ``dp_shard_cp`` (see :func:`apply_expert_fsdp`).

The all-to-alls use ``all_to_all_single`` with uneven splits, which gloo (CPU) and NCCL
both implement; the token all-to-all is autograd-aware (functional collectives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import (
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInputOutput,
    parallelize_module,
)

from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.layers import moe as moe_module
from torchtitan.layers.moe import MoE


# ---------------------------------------------------------------------------- dispatch
@dataclass
class Route:
    """What combine needs to undo a dispatch."""

    input_splits: list[int]
    output_splits: list[int]
    permutation: torch.Tensor


def dispatch(
    tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """Send each token (sorted by global expert id, ``num_tokens_per_expert[e]`` rows for
    expert e) to the rank holding its expert. Returns this rank's tokens sorted by local
    expert, the number per local expert, and the route back. One host sync (the splits)."""
    ep = group.size()
    local_experts = num_tokens_per_expert.numel() // ep
    received = torch.empty_like(num_tokens_per_expert)
    dist.all_to_all_single(received, num_tokens_per_expert, group=group)
    sent, received = num_tokens_per_expert.view(ep, local_experts), received.view(ep, local_experts)
    input_splits, output_splits = moe_module.host_counts(
        torch.stack([sent.sum(1), received.sum(1)]), tokens.shape[0]
    )
    tokens = all_to_all_single_autograd(tokens, output_splits, input_splits, group)
    # Received rows come in (source rank, local expert) blocks; the experts want them
    # grouped by local expert.
    block = torch.repeat_interleave(
        torch.arange(ep * local_experts, device=tokens.device),
        received.flatten(),
        output_size=sum(output_splits),
    )
    source, expert = block // local_experts, block % local_experts
    permutation = (expert * ep + source).argsort(stable=True)
    route = Route(input_splits, output_splits, permutation)
    return tokens[permutation], received.sum(0), route


def combine(tokens: torch.Tensor, route: Route, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of :func:`dispatch`: every token goes back to its source rank and slot."""
    unsorted = torch.empty_like(tokens)
    unsorted[route.permutation] = tokens
    return all_to_all_single_autograd(unsorted, route.input_splits, route.output_splits, group)


class _SumGradOver(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over ``group`` in backward.
    Marks the input of tp-sharded weights, whose input gradient is partial per rank. The
    forward copies: a view made in a Function may not feed a compiled graph that also takes
    its base (DeepSeek-V3's shared experts beside the routed ones)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# ---------------------------------------------------------------------------- styles
class ShardWeights(ParallelStyle):
    """Distribute a module's own parameters with fixed placements (by parameter name);
    the module computes on their local pieces. ``sum_input_grad_dim``: the mesh dim (the
    tp dim) whose ranks hold different weight shards but the same input, whose input
    gradient must therefore be summed."""

    def __init__(
        self, placements: dict[str, Sequence[Placement]], sum_input_grad_dim: int | None = None
    ) -> None:
        super().__init__()
        self.placements = placements
        self.sum_input_grad_dim = sum_input_grad_dim

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:
            return  # only the root module's own parameters
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, mesh, list(self.placements[pname]))
            module.register_parameter(
                pname, nn.Parameter(sharded, requires_grad=param.requires_grad)
            )

    def _sum_input_grad(self, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if self.sum_input_grad_dim is None:
            return x
        return _SumGradOver.apply(x, mesh.get_group(self.sum_input_grad_dim))

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return (self._sum_input_grad(inputs[0], mesh), *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._prepare_input)


class ExpertParallel(ShardWeights):
    """Routed experts sharded over the ep mesh dim (0), optionally also over tp (dim 1),
    with token dispatch before and combine after the experts' forward."""

    def __init__(
        self, placements: dict[str, Sequence[Placement]], sum_input_grad_dim: int | None = None
    ) -> None:
        super().__init__(placements, sum_input_grad_dim)
        self._route: Route | None = None  # from the dispatch of the forward in flight

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        tokens, counts = inputs
        tokens, counts, route = dispatch(tokens, counts, mesh.get_group(0))
        self._route = route
        return self._sum_input_grad(tokens, mesh), counts

    def _combine(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        route, self._route = self._route, None
        return combine(output, route, mesh.get_group(0))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition, self._prepare_input, self._combine
        )


class ReplicatedRouter(ParallelStyle):
    """Router weights replicated over tp. With expert-TP the experts' outputs are partial
    sums over tp, so the gradient of the gating weights that scale them is partial too
    and is summed (the chosen experts and the scores need no gradient correction)."""

    def __init__(self, partial_expert_outputs: bool) -> None:
        super().__init__()
        self.partial_expert_outputs = partial_expert_outputs

    @staticmethod
    def _sum_weights_grad(module: nn.Module, outputs: tuple, mesh: DeviceMesh) -> tuple:
        weights, chosen, scores = outputs
        return _SumGradOver.apply(weights, mesh.get_group()), chosen, scores

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output_fn = self._sum_weights_grad if self.partial_expert_outputs else None
        return distribute_module(module, device_mesh, output_fn=output_fn)


class ReplicatedSharedGate(ParallelStyle):
    """The shared experts' gate replicated over tp. With expert-TP it scales the shared
    experts' partial sums, so its output's gradient is partial and is summed over tp."""

    def __init__(self, partial_shared_outputs: bool) -> None:
        super().__init__()
        self.partial_shared_outputs = partial_shared_outputs

    @staticmethod
    def _sum_grad(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return _SumGradOver.apply(output, mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output_fn = self._sum_grad if self.partial_shared_outputs else None
        return distribute_module(module, device_mesh, output_fn=output_fn)


_ROWS, _COLS = {"w1": 0, "w2": 1, "w3": 0}, {"w1": 1, "w2": 2, "w3": 1}
"""The hidden dim of the shared experts' 2-D and the routed experts' 3-D weights."""
_EXPERT_BIASES = ("b1", "b2", "b3")
"""Routed experts' biases (gpt-oss), ``[experts, ...]``: split by expert like the weights."""


def _on_hidden(
    dims: dict[str, int], prefix: Sequence[Placement] = ()
) -> dict[str, list[Placement]]:
    return {name: [*prefix, Shard(dim)] for name, dim in dims.items()}


def _expert_biases_on_hidden(prefix: Sequence[Placement] = ()) -> dict[str, list[Placement]]:
    """Under expert tensor parallel: ``b1``/``b3`` split on the hidden dim with ``w1``/``w3``,
    ``b2`` (on the partial-sum output, see ``layers/moe._SplitBias``) replicated."""
    return {"b1": [*prefix, Shard(1)], "b3": [*prefix, Shard(1)], "b2": [*prefix, Replicate()]}


def _replicated(names: Sequence[str]) -> dict[str, list[Placement]]:
    return {name: [Replicate()] for name in names}


# ---------------------------------------------------------------------------- MoE plan
def parallelize_moe(moe: MoE, parallel_dims: ParallelDims) -> None:
    """Apply EP / ETP / TP to one MoE layer in place (before FSDP and activation
    checkpointing). With tp, the layer must sit where its input is sequence-sharded."""
    mesh = parallel_dims.world_mesh
    etp = parallel_dims.etp_enabled
    if parallel_dims.ep_enabled:
        if etp:
            placements = _on_hidden(_COLS, [Shard(0)]) | _expert_biases_on_hidden([Shard(0)])
            style = ExpertParallel(placements, sum_input_grad_dim=1)
            parallelize_module(moe.experts, mesh[("ep", "tp")], style)
        else:
            style = ExpertParallel({name: [Shard(0)] for name in (*_COLS, *_EXPERT_BIASES)})
            parallelize_module(moe.experts, mesh["ep"], style)
    if not parallel_dims.tp_enabled:
        return
    tp_mesh = mesh["tp"]
    parallelize_module(
        moe,
        tp_mesh,
        PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Partial() if etp else Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        ),
    )
    parallelize_module(moe.router, tp_mesh, ReplicatedRouter(partial_expert_outputs=etp))
    if moe.shared_experts is not None:
        shared = ShardWeights(_on_hidden(_ROWS), 0) if etp else ShardWeights(_replicated(_ROWS))
        parallelize_module(moe.shared_experts, tp_mesh, shared)
    if moe.shared_gate is not None:
        parallelize_module(moe.shared_gate, tp_mesh, ReplicatedSharedGate(etp))
    if not parallel_dims.ep_enabled:
        experts = (
            ShardWeights(_on_hidden(_COLS) | _expert_biases_on_hidden(), 0)
            if etp
            else ShardWeights(_replicated((*_COLS, *_EXPERT_BIASES)))
        )
        parallelize_module(moe.experts, tp_mesh, experts)


def apply_expert_fsdp(
    experts: nn.Module,
    parallel_dims: ParallelDims,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool = False,
) -> None:
    """FSDP for expert-parallel experts (a MoE layer's routed experts, split over ``ep``)
    over the data-parallel ranks that hold the same experts (``efsdp``, with
    ``dp_replicate`` for HSDP); arguments as for ``apply_fsdp``.
    Their gradients already sum the tokens of a whole EP group, so they are divided by the
    full data-parallel size (as the dense gradients are), not by the efsdp size."""
    mesh = parallel_dims.world_mesh
    efsdp = mesh[("dp_replicate", "efsdp")] if parallel_dims.dp_replicate_enabled else mesh["efsdp"]
    fully_shard(
        experts,
        mesh=efsdp,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        reshard_after_forward=reshard_after_forward,
        **({"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}),
    )
    dp_size = parallel_dims.dp_replicate * parallel_dims.dp_shard * parallel_dims.cp
    experts.set_gradient_divide_factor(dp_size)
    if efsdp.device_type == "cpu" and mesh["efsdp"].size() > 1:
        # gloo has no PREMUL_SUM. Not on a 1-rank efsdp: torch's FSDP (2.13) then divides by
        # the factor when copying instead of reduce-scattering, and again afterwards.
        experts.set_force_sum_reduction_for_comms(True)
