"""Mixture-of-experts layer shared by MoE models.

A token-choice top-k router (softmax or sigmoid scores, optional group-limited routing; or
gpt-oss's softmax over the chosen logits, with a router bias), routed experts held as
stacked 3-D SwiGLU weights (``w1``/``w3``: ``[experts, hidden, dim]``, ``w2``: ``[experts,
dim, hidden]``; gpt-oss adds per-expert biases ``b1``/``b3`` ``[experts, hidden]`` and ``b2``
``[experts, dim]`` and clamps its SwiGLU), optional shared experts, and auxiliary-loss-free
load balancing (DeepSeek-V3): a per-expert bias added to the scores only when *choosing*
experts, nudged before every optimizer step towards balance by :func:`update_expert_biases` (the
optimizer side hooks it in: ``components/optimizer.build_moe_optimizers``).

Every MoE parameter is used through its local tensor (:func:`local`), so expert parallel
and tensor parallel (``torchtitan.distributed.expert_parallel``) only choose how the weights
are sharded and how tokens reach the experts; this module never communicates.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.layers.grouped_mm import grouped_mm
from torchtitan.layers.init import clean_fqn
from torchtitan.tools.logging import logger


@dataclass
class MoEArgs:
    num_experts: int = 8
    num_shared_experts: int = 1
    top_k: int = 2
    # "topk_softmax" (gpt-oss): choose by the logits, weigh by a softmax over the chosen ones.
    score_func: Literal["softmax", "sigmoid", "topk_softmax"] = "softmax"
    router_bias: bool = False  # the router's linear layer has a bias (gpt-oss)
    # Divide the top-k scores by their sum (DeepSeek-V3's norm_topk_prob).
    route_norm: bool = False
    route_scale: float = 1.0
    # Group-limited routing: experts form num_expert_groups groups; each token only picks
    # experts from its num_limited_groups best groups (a group scores its top-2 experts).
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    # Expert-bias step per optimizer step; None disables aux-loss-free load balancing.
    load_balance_coeff: float | None = 1e-3
    # Weight of DeepSeek-V3's sequence-wise balance loss; 0 disables it.
    aux_loss_alpha: float = 0.0
    # Route round-robin by sequence position (debug.moe_force_load_balance).
    force_load_balance: bool = False
    use_grouped_mm: bool = True
    # gpt-oss experts: biases on every projection, and the clamped SwiGLU
    # (up + 1) * g * sigmoid(alpha * g) with g = min(gate, limit), up within +-limit.
    expert_biases: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Qwen3.5-MoE / Qwen2-MoE: the shared experts' output is scaled by sigmoid(x . w), one
    # learned gate vector (moe.shared_gate) per layer.
    shared_expert_gate: bool = False

    @property
    def activation(self) -> Activation:
        if self.swiglu_limit is None:
            return _silu_glu
        return functools.partial(_clamped_glu, limit=self.swiglu_limit, alpha=self.swiglu_alpha)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local piece of a (possibly) sharded parameter. Its gradient keeps the
    parameter's placements: the callers feed every tensor-parallel rank the same tokens."""
    return t.to_local() if isinstance(t, DTensor) else t


def host_counts(counts: torch.Tensor, rows: int) -> list:
    """Token counts as host integers (one device sync); each row of ``counts`` sums to
    ``rows`` (what a reader without the values, such as the memory estimator's
    ``estimate.emulation.balanced_moe_routing``, needs to split them)."""
    return counts.tolist()


def _recomputing() -> bool:
    """True inside autograd's backward pass, which is where eager activation checkpointing
    re-runs forward (reentrant or not): such a forward must not count tokens again. A
    compiled block never re-runs the count: its buffer update belongs to the forward graph,
    and the backward graph recomputes only what gradients need."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------------------- router
class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=args.router_bias)
        self.args = args

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[tokens, dim]`` (whole sequences of ``seq_len``) -> (gating weights
        ``[tokens, top_k]`` fp32, chosen experts ``[tokens, top_k]``, scores ``[tokens,
        experts]`` fp32). The bias only steers the choice; weights are unbiased scores."""
        args = self.args
        bias = None if self.gate.bias is None else local(self.gate.bias).float()
        logits = F.linear(x.float(), local(self.gate.weight).float(), bias)
        if args.score_func == "topk_softmax":
            return self._topk_softmax(logits, expert_bias, seq_len)
        scores = logits.sigmoid() if args.score_func == "sigmoid" else logits.softmax(dim=-1)
        if args.force_load_balance:
            chosen = self._round_robin(x.shape[0], seq_len, x.device)
        else:
            choice = scores if expert_bias is None else scores + expert_bias
            if args.num_expert_groups:
                choice = self._limit_groups(choice)
            chosen = choice.topk(args.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if args.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * args.route_scale, chosen, scores

    def _topk_softmax(
        self, logits: torch.Tensor, expert_bias: torch.Tensor | None, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gpt-oss: the top-k logits chosen (the balancing bias, if any, only steers the
        choice), their softmax the weights; scores for balance losses: softmax of all."""
        args = self.args
        if args.force_load_balance:
            chosen = self._round_robin(logits.shape[0], seq_len, logits.device)
        else:
            choice = logits if expert_bias is None else logits + expert_bias
            chosen = choice.topk(args.top_k, dim=-1).indices
        weights = logits.gather(1, chosen).softmax(dim=-1)
        return weights * args.route_scale, chosen, logits.softmax(dim=-1)

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        args = self.args
        grouped = choice.view(choice.shape[0], args.num_expert_groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = group_scores.topk(args.num_limited_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    def _round_robin(self, n_tokens: int, seq_len: int, device: torch.device) -> torch.Tensor:
        """Token at sequence position p picks experts ``(p * top_k + j) % experts``: the
        same choice under every data/tensor-parallel layout, and perfectly balanced."""
        k, n = self.args.top_k, self.args.num_experts
        position = torch.arange(n_tokens, device=device) % seq_len
        return (position[:, None] * k + torch.arange(k, device=device)) % n


# ---------------------------------------------------------------------------- experts
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(gate, up) -> hidden`` of a gated feed-forward."""


def _silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _clamped_glu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


def _swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    biases: tuple | None = None,
    act: Activation = _silu_glu,
) -> torch.Tensor:
    b1, b2, b3 = biases if biases is not None else (None, None, None)
    return F.linear(act(F.linear(x, w1, b1), F.linear(x, w3, b3)), w2, b2)


def _experts_loop(x, counts, w1, w2, w3, biases=None, act=_silu_glu) -> torch.Tensor:
    chunks = x.split(host_counts(counts, x.shape[0]))
    return torch.cat(
        [
            _swiglu(c, w1[e], w2[e], w3[e], None if biases is None else [b[e] for b in biases], act)
            for e, c in enumerate(chunks)
        ]
    )


def _experts_grouped(x, counts, w1, w2, w3, biases=None, act=_silu_glu) -> torch.Tensor:
    offsets = counts.cumsum(0).to(torch.int32)
    traceable = x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    matmul = torch._grouped_mm if traceable else grouped_mm

    def project(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = matmul(h, w.transpose(-2, -1), offs=offsets)
        if b is None:
            return out
        # each row's expert bias, without a host sync (the row count is known)
        return out + b.repeat_interleave(counts, dim=0, output_size=h.shape[0])

    b1, b2, b3 = biases if biases is not None else (None, None, None)
    return project(act(project(x, w1, b1), project(x, w3, b3)), w2, b2)


_PROBED: dict[tuple, bool] = {}


@torch._dynamo.assume_constant_result
def grouped_mm_works(device: torch.device, dtype: torch.dtype, dim: int, hidden: int) -> bool:
    """Capability probe, once per device, dtype and shape: decides the expert kernel. A
    compiled block runs it while tracing and keeps the answer as a constant."""
    key = (device, dtype, dim, hidden)
    if key not in _PROBED:
        _PROBED[key] = _probe_grouped_mm(*key)
    return _PROBED[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype, dim: int, hidden: int) -> bool:
    """Run ``torch._grouped_mm`` on this device and dtype with these expert shapes and
    uneven groups (one empty) and compare with plain matmuls; no GPU model is hard-coded.
    Forward only, without autograd or autocast, so that it is safe inside any forward
    (activation checkpointing included)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(7, dim, device=device, dtype=dtype, generator=gen)
    ws = [
        torch.randn(3, *shape, device=device, dtype=dtype, generator=gen) / dim**0.5
        for shape in ((hidden, dim), (dim, hidden), (hidden, dim))
    ]
    counts = torch.tensor([4, 0, 3], device=device)
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        try:
            grouped = _experts_grouped(x, counts, *ws)
        except (RuntimeError, NotImplementedError) as e:
            logger.info(
                f"torch._grouped_mm unavailable on {device.type}/{dtype} ({e}); "
                "using per-expert matmuls"
            )
            return False
        reference = _experts_loop(x, counts, *ws)
    tol = 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    if not torch.allclose(grouped.float(), reference.float(), rtol=tol, atol=tol):
        logger.warning(
            f"torch._grouped_mm disagrees with matmuls on {device.type}/{dtype}; "
            "using per-expert matmuls"
        )
        return False
    return True


class _SplitBias(torch.autograd.Function):
    """``bias / ways`` forward, the gradient unchanged backward: the output bias of experts
    whose outputs are partial sums over ``ways`` expert-tensor-parallel ranks, added once in
    the sum. Each rank's output gradient is the whole one (the sum's gradient), so each
    gets the bias's whole gradient and the replicated bias stays equal on every rank."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, ways: int) -> torch.Tensor:
        return bias / ways

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _partial_ways(w2: torch.Tensor) -> int:
    """Over how many ranks the experts' outputs are partial sums: those that split ``w2``'s
    hidden dim (expert tensor parallel); 1 otherwise."""
    if not isinstance(w2, DTensor):
        return 1
    mesh = w2.device_mesh
    return math.prod(
        [mesh.size(i) for i, p in enumerate(w2.placements) if p.is_shard() and p.dim == 2]
    )


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU FFNs applied to tokens already sorted by expert (``biases``:
    per-expert ``b1``/``b3`` ``[experts, hidden]`` and ``b2`` ``[experts, dim]``)."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        use_grouped_mm: bool,
        biases: bool = False,
        activation: Activation = _silu_glu,
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        if biases:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.has_biases = biases
        self.activation = activation
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x`` ``[n, dim]`` with the first ``num_tokens_per_expert[0]`` rows for (local)
        expert 0, and so on."""
        w1, w2, w3 = local(self.w1), local(self.w2), local(self.w3)
        biases = None
        if self.has_biases:
            b2, ways = local(self.b2), _partial_ways(self.w2)
            if ways > 1:
                b2 = _SplitBias.apply(b2, ways)
            biases = (local(self.b1), b2, local(self.b3))
        x = x.to(w1.dtype)
        dim, hidden = w1.shape[2], w1.shape[1]
        if self.use_grouped_mm and grouped_mm_works(x.device, x.dtype, dim, hidden):
            experts = _experts_grouped
        else:
            experts = _experts_loop
        return experts(x, num_tokens_per_expert, w1, w2, w3, biases, self.activation)


class SharedExperts(nn.Module):
    """The always-active experts as one SwiGLU FFN on local weights, so that tensor
    parallel can shard them like the routed experts (their output is then partial)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(hidden_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _swiglu(x, local(self.w1), local(self.w2), local(self.w3))


class SharedExpertGate(nn.Module):
    """``sigmoid(x . weight)`` per token: how much of the shared experts' output a token
    takes (Qwen3.5-MoE). On local weights, like the shared experts."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, local(self.weight)))


# ---------------------------------------------------------------------------- MoE layer
class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, feeds ``scale`` as the aux loss's gradient, so the
    loss trains the router without the trainer adding it to the reported loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


class MoE(nn.Module):
    """Routed experts of ``hidden_dim`` plus shared experts of ``shared_hidden_dim`` (default
    ``hidden_dim * num_shared_experts``)."""

    def __init__(
        self, dim: int, hidden_dim: int, args: MoEArgs, shared_hidden_dim: int | None = None
    ) -> None:
        super().__init__()
        self.args = args
        self.router = TokenChoiceTopKRouter(dim, args)
        self.experts = GroupedExperts(
            dim,
            hidden_dim,
            args.num_experts,
            args.use_grouped_mm,
            biases=args.expert_biases,
            activation=args.activation,
        )
        if shared_hidden_dim is None:
            shared_hidden_dim = hidden_dim * args.num_shared_experts
        self.shared_experts = (
            SharedExperts(dim, shared_hidden_dim) if args.num_shared_experts > 0 else None
        )
        self.shared_gate = (
            SharedExpertGate(dim)
            if args.shared_expert_gate and self.shared_experts is not None
            else None
        )
        # Only with aux-loss-free balancing (else no state-dict entry, as in checkpoints of
        # models routed without one, e.g. Hugging Face's Qwen3-MoE).
        balanced = args.load_balance_coeff is not None
        self.register_buffer("expert_bias", torch.zeros(args.num_experts) if balanced else None)
        # Tokens routed to each expert since the last optimizer step (this rank's tokens).
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        # Global counts of the last step, for metrics (set by the optimizer pre-step hook).
        self.last_tokens_per_expert: torch.Tensor | None = None
        # 1 / gradient-accumulation steps, set by the recipe (torchtitan/recipe.py).
        self.aux_loss_scale = 1.0

    def reset_buffers(self) -> None:
        if self.expert_bias is not None:
            self.expert_bias.zero_()
        self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, chosen, scores = self.router(tokens, self.expert_bias, seq_len)

        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.searchsorted(
            flat[order], torch.arange(self.args.num_experts + 1, device=x.device)
        ).diff()
        if self.training and not _recomputing():
            self.tokens_per_expert.add_(counts)

        routed = self.experts(tokens[order // self.args.top_k], counts)
        unsorted = torch.empty_like(routed)
        unsorted[order] = routed
        top_k_out = unsorted.view(-1, self.args.top_k, dim).float() * weights.unsqueeze(-1)
        out = top_k_out.sum(dim=1).to(x.dtype)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_gate is not None:
                shared = shared * self.shared_gate(tokens)
            out = out + shared
        if self.args.aux_loss_alpha > 0 and self.training:
            aux = self._sequence_balance_loss(scores, chosen, bsz, seq_len)
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_scale)
        return out.view(bsz, seq_len, dim)

    def _sequence_balance_loss(
        self, scores: torch.Tensor, chosen: torch.Tensor, bsz: int, seq_len: int
    ) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, ``alpha * sum_i f_i * P_i`` averaged
        over sequences: f_i = experts / (top_k * seq_len) * tokens choosing i, P_i = mean
        over the sequence of i's normalised score."""
        n, k = self.args.num_experts, self.args.top_k
        picks = torch.zeros(bsz * seq_len, n, device=scores.device).scatter_(1, chosen, 1.0)
        f = picks.view(bsz, seq_len, n).sum(dim=1) * (n / (k * seq_len))
        normalised = scores / scores.sum(dim=-1, keepdim=True)
        p = normalised.view(bsz, seq_len, n).mean(dim=1)
        return self.args.aux_loss_alpha * (f * p).sum(dim=-1).mean()


# ---------------------------------------------------------------------------- balancing
def moe_layers(model_parts: list[nn.Module]) -> dict[str, MoE]:
    """Every MoE layer, keyed by its block's name (``"3"`` for ``layers.3.moe``)."""
    found = {}
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                found[clean_fqn(name).removeprefix("layers.").removesuffix(".moe")] = module
    return found


@torch.no_grad()
def update_expert_biases(moes: list[MoE], dp_cp_group: dist.ProcessGroup | None) -> None:
    """Sum this step's token counts over the data (and context) parallel ranks, keep them
    for metrics, move each bias by ``coeff * sign(mean - count)`` and reset the counts."""
    if not moes:
        return
    counts = torch.stack([m.tokens_per_expert for m in moes])
    if dp_cp_group is not None:
        dist.all_reduce(counts, group=dp_cp_group)
    for moe, count in zip(moes, counts):
        moe.last_tokens_per_expert = count.clone()
        coeff = moe.args.load_balance_coeff
        if coeff is not None:
            moe.expert_bias.add_(coeff * torch.sign(count.mean() - count))
        moe.tokens_per_expert.zero_()


def moe_load_metrics(model_parts: list[nn.Module]) -> dict[str, float]:
    """Per MoE layer, max / mean tokens per expert of the last optimizer step (1.0 is
    perfect balance), e.g. ``{"moe/layer3_imbalance": 1.42}``. One host sync and no
    communication: the counts were already summed over the data-parallel ranks."""
    counts = {
        name: moe.last_tokens_per_expert
        for name, moe in moe_layers(model_parts).items()
        if moe.last_tokens_per_expert is not None
    }
    if not counts:
        return {}
    stacked = torch.stack(list(counts.values()))
    imbalance = stacked.max(dim=1).values / stacked.mean(dim=1).clamp(min=1e-9)
    return {f"moe/layer{name}_imbalance": value for name, value in zip(counts, imbalance.tolist())}
