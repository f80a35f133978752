"""Gated DeltaNet: the linear-attention mixer of Qwen3.5 and Qwen3-Next.

Per head, a ``[k_dim, v_dim]`` state ``S`` is decayed and corrected token by token (the gated
delta rule): ``S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T`` and the output
is ``S_t^T q_t``, with ``g_t = -exp(A_log) softplus(a_t + dt_bias)`` (a per-head decay) and
``beta_t = sigmoid(b_t)``. Queries, keys and values come from one projection through a short
causal depthwise convolution and SiLU; queries and keys are L2-normalised (queries also scaled
by ``k_dim ** -0.5``); the output passes a gated RMSNorm (``norm(o) * silu(z)``) and an output
projection.

Training runs the chunked form (:func:`chunk_gated_delta_rule`, pure PyTorch, fp32, chunks of
``chunk_size`` tokens): within a chunk the delta rule's sequential corrections are one
unit-lower-triangular solve (the WY / UT form of DeltaNet), across chunks the state is carried
one chunk at a time. Generation runs the recurrent form (:func:`recurrent_gated_delta_rule`).
Written here: torch has no delta-rule op, and the fla kernels (CUDA/Triton only) are an
optional dependency. Where they are installed, :class:`DeltaRule` runs the rule on CUDA through
fla's fused Triton chunked kernel instead (``layers/fla_delta_rule.py``, the same numbers).

Packed documents (``document_ids``, non-decreasing along a sequence): the state and the
convolution restart at every document start, so documents never see each other.

The convolution and the rule run in a swappable kernel (:class:`DeltaRule`, the recurrent
counterpart of the attention seam, ``layers/attention.py``): context parallel replaces it with
one that hands states between ranks, generation with one that keeps the state and the
convolution's tail between calls. Queries, keys and values have their own projections and
convolution weights (Hugging Face fuses them in one ``in_proj_qkv`` / ``conv1d``; the
state-dict adapter splits them), so tensor parallel shards each by heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.layers.attention import AttentionKernel, MaskSpec, own_mask
from torchtitan.layers.fla_delta_rule import fla_available, fla_gated_delta_rule
from torchtitan.layers.init import InitFn, ones_init
from torchtitan.layers.moe import local


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the fla kernels' normalisation)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``out_t = sum_j weight[:, K - 1 - j] * x_{t - j}`` over ``j < K`` for ``x`` ``[batch,
    seq, channels]`` and ``weight`` ``[channels, K]``: earlier positions outside the sequence
    or in another document count as zero."""
    kernel = weight.shape[-1]
    seq = x.shape[1]
    out = x * weight[:, kernel - 1]
    for j in range(1, kernel):
        earlier = F.pad(x, (0, 0, j, 0))[:, :seq]
        if document_ids is not None:
            same = F.pad(document_ids, (j, 0), value=-1)[:, :seq] == document_ids
            earlier = earlier * same.unsqueeze(-1)
        out = out + earlier * weight[:, kernel - 1 - j]
    return out


def _chunked(x: torch.Tensor, size: int) -> torch.Tensor:
    """``[batch, heads, seq, ...] -> [batch, heads, chunks, size, ...]``."""
    return x.unflatten(2, (-1, size))


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
    document_ids: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``q``/``k`` ``[batch, heads, seq, k_dim]`` (queries already
    scaled), ``v`` ``[batch, heads, seq, v_dim]``, log-decays ``g`` and ``beta`` ``[batch,
    heads, seq]``, in fp32 whatever the inputs; returns (output like ``v`` in fp32, final state
    ``[batch, heads, k_dim, v_dim]``). ``initial_state`` continues the first token's document.
    """
    batch, heads, seq, k_dim = k.shape
    v_dim = v.shape[-1]
    pad = (-seq) % chunk_size
    q, k, v = (F.pad(t.float(), (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.float(), (0, pad)) for t in (g, beta))
    docs = torch.zeros(batch, seq, dtype=torch.long, device=q.device)
    if document_ids is not None:
        docs = document_ids
    docs = F.pad(docs, (0, pad), mode="replicate")[:, None]  # [batch, 1, padded seq]
    # the document of the state entering each chunk: the token before it (the first token's
    # own for the first chunk)
    previous = torch.cat([docs[..., :1], docs[..., :-1]], dim=-1)
    q, k, v, docs, previous = (_chunked(t, chunk_size) for t in (q, k, v, docs, previous))
    g, beta = _chunked(g, chunk_size), _chunked(beta, chunk_size)
    entering = previous[..., :1]  # [batch, 1, chunks, 1]
    cum = g.cumsum(-1)
    visible = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    same = (docs.unsqueeze(-1) == docs.unsqueeze(-2)) & visible  # [b, 1, n, C, C]
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~same, float("-inf")).exp()
    continues = (docs == entering).float()  # reads the state that enters the chunk
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    corrections = (k_beta @ k.transpose(-1, -2)) * decay
    eye = torch.eye(chunk_size, device=q.device)
    system = corrections.tril(-1) + eye
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    reads = (cum.exp() * continues).unsqueeze(-1)
    w = torch.linalg.solve_triangular(system, k_beta * reads, upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    last_doc = docs[..., -1:]
    tail = ((cum[..., -1:] - cum).exp() * (docs == last_doc)).unsqueeze(-1)  # [b, h, n, C, 1]
    carry = cum[..., -1].exp() * (last_doc == entering)[..., 0]  # [b, h, n]
    state = q.new_zeros(batch, heads, k_dim, v_dim)
    if initial_state is not None:
        state = initial_state.float()
    reading, writing = q * reads, (k * tail).transpose(-1, -2)
    # one unbind per tensor, not an index per chunk: indexing's backward writes a zero tensor
    # of the whole input per chunk, quadratic in the sequence length
    per_chunk = zip(*(t.unbind(2) for t in (u, w, reading, intra, writing, carry[..., None, None])))
    outs = []
    for u_c, w_c, reading_c, intra_c, writing_c, carry_c in per_chunk:
        v_new = u_c - w_c @ state
        outs.append(reading_c @ state + intra_c @ v_new)
        state = state * carry_c + writing_c @ v_new
    out = torch.cat(outs, dim=2)[:, :, :seq]
    return out, state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule one token at a time (generation, and the reference of the chunked form);
    shapes as :func:`chunk_gated_delta_rule`, one document."""
    batch, heads, seq, k_dim = k.shape
    if state is None:
        state = q.new_zeros(batch, heads, k_dim, v.shape[-1], dtype=torch.float32)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    outs = []
    for q_t, k_t, v_t, g_t, beta_t in zip(*(t.unbind(2) for t in (q, k, v, g, beta))):
        state = state * g_t[..., None, None].exp()
        predicted = (k_t.unsqueeze(-2) @ state).squeeze(-2)
        correction = (v_t - predicted) * beta_t[..., None]
        state = state + k_t.unsqueeze(-1) * correction.unsqueeze(-2)
        outs.append((q_t.unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outs, dim=2), state


def uniform_init(low: float, high: float) -> InitFn:
    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        t.uniform_(low, high, generator=g)

    return fill


def log_uniform_init(low: float, high: float) -> InitFn:
    """``log(U(low, high))``: the decay rates ``exp(A_log)`` spread over ``[low, high]``
    (Mamba's and Gated DeltaNet's initialisation)."""

    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        t.uniform_(low, high, generator=g).log_()

    return fill


class HeadRMSNorm(nn.Module):
    """``weight * rmsnorm(x)`` over the last dim (one head's channels), normalised in fp32.
    Its output is then gated (:meth:`GatedDeltaNet.gate_output`); the two are apart so that
    tensor parallel can treat the norm like attention's per-head q/k norms."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return self.weight * normed


@dataclass(frozen=True)
class RecurrentSpec(MaskSpec):
    """A recurrent mixer's mask: only document starts (``block_causal``). A class of its own
    so that :func:`~torchtitan.layers.attention.prepare_mask` prepares it apart from the
    attention layers' masks."""


class DeltaRule(AttentionKernel):
    """The sequence part of :class:`GatedDeltaNet` on one device: the causal convolution
    (:meth:`conv`) and the chunked gated delta rule (``forward``). Its prepared mask is the
    batch's document ids (None without ``block_causal``)."""

    def __init__(self, chunk_size: int, spec: RecurrentSpec = RecurrentSpec()) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self.spec = spec

    def prepare(self, document_ids: torch.Tensor | None, device: torch.device) -> Any:
        return document_ids if self.spec.block_causal else None

    def conv(self, x: torch.Tensor, weight: torch.Tensor, mask: Any = None) -> torch.Tensor:
        """:func:`causal_depthwise_conv` of ``x`` ``[batch, seq, channels]``."""
        return causal_depthwise_conv(x, weight, own_mask(mask, self.spec))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        mask: Any = None,
    ) -> torch.Tensor:
        """:func:`chunk_gated_delta_rule`'s output (fp32) for ``[batch, heads, seq, ...]``: by
        fla's kernel where :func:`fla_available` (its backward too when gradients are needed),
        else in pure PyTorch."""
        document_ids = own_mask(mask, self.spec)
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
        if fla_available(q.device, backward=backward):
            return fla_gated_delta_rule(q, k, v, g, beta, document_ids)
        out, _ = chunk_gated_delta_rule(
            q, k, v, g, beta, self.chunk_size, document_ids=document_ids
        )
        return out

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, block_causal={self.spec.block_causal}"


class GatedDeltaNet(nn.Module):
    """The mixer (see the module docstring): ``forward(x, rope_cache, positions, mask)`` on
    ``[batch, seq, dim]`` (called like an attention layer; RoPE is not used). ``n_v_heads``
    may be a multiple of ``n_k_heads`` (each query/key head then serves that many consecutive
    value heads). Head counts are read from the projections at run time, so tensor parallel
    can shard heads. Its own parameters carry their initialisation (``param_init_fns``):
    convolution taps uniform within ``1 / sqrt(kernel)`` (PyTorch's Conv1d default), decay
    rates log-uniform over [1, 16], ``dt_bias`` one; the projections follow the model's
    rules."""

    def __init__(
        self,
        dim: int,
        n_k_heads: int,
        n_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel: int,
        norm_eps: float,
        chunk_size: int = 64,
        block_causal: bool = False,
    ) -> None:
        super().__init__()
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        key_dim, value_dim = n_k_heads * k_head_dim, n_v_heads * v_head_dim
        self.q_proj = nn.Linear(dim, key_dim, bias=False)
        self.k_proj = nn.Linear(dim, key_dim, bias=False)
        self.v_proj = nn.Linear(dim, value_dim, bias=False)
        self.z_proj = nn.Linear(dim, value_dim, bias=False)
        self.b_proj = nn.Linear(dim, n_v_heads, bias=False)
        self.a_proj = nn.Linear(dim, n_v_heads, bias=False)
        # depthwise causal convolution taps per channel, [channels, kernel]
        self.q_conv = nn.Parameter(torch.empty(key_dim, conv_kernel))
        self.k_conv = nn.Parameter(torch.empty(key_dim, conv_kernel))
        self.v_conv = nn.Parameter(torch.empty(value_dim, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))
        self.A_log = nn.Parameter(torch.zeros(n_v_heads))
        self.norm = HeadRMSNorm(v_head_dim, norm_eps)
        self.out_proj = nn.Linear(value_dim, dim, bias=False)
        self.inner_rule = DeltaRule(chunk_size, RecurrentSpec(block_causal=block_causal))
        bound = conv_kernel**-0.5
        self.param_init_fns: dict[str, InitFn] = {
            "q_conv": uniform_init(-bound, bound),
            "k_conv": uniform_init(-bound, bound),
            "v_conv": uniform_init(-bound, bound),
            "A_log": log_uniform_init(1.0, 16.0),
            "dt_bias": ones_init,
        }

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        sizes = [q.shape[-1], k.shape[-1], v.shape[-1]]
        weight = torch.cat([local(self.q_conv), local(self.k_conv), local(self.v_conv)])
        mixed = F.silu(self.inner_rule.conv(torch.cat([q, k, v], dim=-1), weight, mask))
        q, k, v = mixed.split(sizes, dim=-1)
        q, k = (t.unflatten(-1, (-1, self.k_head_dim)).float() for t in (q, k))
        q = l2_normalize(q) * self.k_head_dim**-0.5
        k = l2_normalize(k)
        v = v.unflatten(-1, (-1, self.v_head_dim))
        repeat = v.shape[2] // k.shape[2]
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        beta = torch.sigmoid(self.b_proj(x).float())
        decay_rate = local(self.A_log).float().exp()
        g = -decay_rate * F.softplus(self.a_proj(x).float() + local(self.dt_bias))
        out = self.inner_rule(*(t.transpose(1, 2) for t in (q, k, v, g, beta)), mask=mask)
        out = out.transpose(1, 2).to(x.dtype)
        z = self.z_proj(x).unflatten(-1, (-1, self.v_head_dim))
        return self.out_proj(self.gate_output(self.norm(out), z).reshape(batch, seq, -1))

    @staticmethod
    def gate_output(normed: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm's gate: ``normed * silu(z)`` in fp32."""
        return (normed.float() * F.silu(z.float())).to(normed.dtype)
