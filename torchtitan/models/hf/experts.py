"""Expert parallel for transformers' MoE layers whose experts are stacked 3-D tensors (the
classes transformers decorates with ``use_experts_implementation``: ``gate_up_proj``
``[experts, 2 * hidden, dim]``, ``down_proj`` ``[experts, dim, hidden]``, optional per-expert
biases, transposed or interleaved as the model stores them).

The router stays transformers' (the MoE block calls it as before), and so does the experts'
math: each EP rank holds ``num_experts / ep`` experts (every stacked parameter ``Shard(0)``
over ``world_mesh["ep"]``); the experts' forward sorts the (token, choice) pairs by expert,
sends each to the rank holding its expert (``distributed/expert_parallel.dispatch``), runs
transformers' own experts forward (whichever ``experts_implementation`` the config names) on
the local experts with unit weights, brings the rows back (``combine``), and weighs and sums
them per token as transformers does.
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchtitan.config.errors import ConfigError
from torchtitan.distributed.expert_parallel import combine, dispatch
from torchtitan.layers.moe import local
from torchtitan.models.hf.model import shallow_copy


def stacked_experts(model: nn.Module) -> dict[str, nn.Module]:
    """transformers' stacked-experts modules of ``model`` by FQN."""
    return {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts")
    }


def _check_shardable(name: str, experts: nn.Module, ep: int) -> None:
    """Every parameter of the module must be stacked per expert, and ``ep`` must divide
    the experts (one line naming what does not fit)."""
    count = experts.num_experts
    if count % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree ({ep}) must divide the {count} experts of "
            f"{name}; pick a divisor of {count}"
        )
    for pname, param in experts.named_parameters():
        if "." in pname or param.ndim < 2 or param.shape[0] != count:
            raise ConfigError(
                f"parallelism.expert_parallel_degree: {name}.{pname} is not stacked per expert "
                f"({type(experts).__name__}), so expert parallel cannot split it; leave the "
                "degree at 1"
            )


def _local_view(experts: nn.Module, local_count: int) -> nn.Module:
    """A shallow copy of ``experts`` whose parameters are this rank's pieces (autograd
    flows to the sharded parameters) and whose ``num_experts`` is the local count."""
    view = shallow_copy(experts)
    view._parameters = {name: local(p) for name, p in experts._parameters.items()}
    view.num_experts = local_count
    return view


def _expert_parallel_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts forward (``[tokens, dim]``, the chosen experts and their
    weights ``[tokens, top_k]`` -> ``[tokens, dim]``) over experts split across the ep
    ranks."""
    tokens, top_k = top_k_index.shape
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    counts = torch.bincount(expert_ids, minlength=self.num_experts)
    rows, local_counts, route = dispatch(hidden_states[order // top_k], counts, self.ep_group)
    local_count = self.num_experts // self.ep_group.size()
    local_ids = torch.repeat_interleave(
        torch.arange(local_count, device=rows.device), local_counts, output_size=rows.shape[0]
    )
    unit = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
    out = type(self).forward(_local_view(self, local_count), rows, local_ids[:, None], unit)
    out = combine(out, route, self.ep_group)
    weighted = out * top_k_weights.reshape(-1)[order, None]
    per_choice = torch.empty_like(weighted)
    per_choice[order] = weighted
    return per_choice.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Split every stacked-experts module of ``model`` over ``ep_mesh`` (before FSDP);
    returns them (FSDP wraps each over ``efsdp`` first). One line where a model has none or
    one does not split."""
    found = stacked_experts(model)
    if not found:
        raise ConfigError(
            "parallelism.expert_parallel_degree: this model has no experts stored as stacked "
            "tensors (transformers' use_experts_implementation); leave the degree at 1"
        )
    for name, experts in found.items():
        _check_shardable(name, experts, ep_mesh.size())
        for pname, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(pname, nn.Parameter(sharded, param.requires_grad))
        experts.ep_group = ep_mesh.get_group()
        experts.forward = MethodType(_expert_parallel_forward, experts)
    return list(found.values())
