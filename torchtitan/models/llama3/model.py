"""The Llama 3 transformer.

RoPE uses Meta's original layout: within each head, adjacent channels
``(2i, 2i + 1)`` form the pair rotated at frequency ``i``. It is computed with
real cos/sin tables (no complex tensors) so it composes with DTensor.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.attention import build_attention, prepare_mask
from torchtitan.models.init import (
    InitFn,
    clean_fqn,
    init_param_,
    normal_init,
    ones_init,
    trunc_normal_init,
)
from torchtitan.models.llama3.args import TransformerModelArgs

_BASE_STD = 0.02


def rope_inv_freq(args: TransformerModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` in fp32, with Llama 3.1
    scaling when ``args.use_scaled_rope``: low frequencies (long wavelengths)
    are divided by the scale factor, high ones kept, and the band between is
    interpolated smoothly."""
    head_dim = args.head_dim
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    if not args.use_scaled_rope:
        return inv_freq
    factor = args.rope_scale_factor
    old_len = args.rope_original_max_position_embeddings
    low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, smoothed)
    return torch.where(wavelen < old_len / high, inv_freq, scaled)


def precompute_rope_cache(
    args: TransformerModelArgs, device: torch.device | None = None
) -> torch.Tensor:
    """``[max_seq_len, head_dim]`` fp32 table: cos in the first half of the
    last dim, sin in the second, row ``p`` for position ``p``."""
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, rope_inv_freq(args, device))
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    rope_cache: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``xq``/``xk`` (``[batch, seq, heads, head_dim]``) by their positions.

    ``positions`` holds each token's absolute position, shaped ``[seq]`` or
    ``[batch, seq]`` (context parallelism passes the global positions of a
    local sequence shard); by default ``0 .. seq - 1``. The rotation is done
    in fp32 and the results are cast back to the inputs' dtypes.
    """
    seq_len = xq.shape[1]
    table = rope_cache[:seq_len] if positions is None else rope_cache[positions]
    cos, sin = table.unsqueeze(-2).chunk(2, dim=-1)  # broadcast over heads
    return _rotate(xq, cos, sin), _rotate(xk, cos, sin)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, s, kv_heads, d] -> [b, s, kv_heads * n_rep, d]``; query head ``j``
    then uses KV head ``j // n_rep``."""
    if n_rep == 1:
        return x
    b, s, kv_heads, d = x.shape
    return x.unsqueeze(3).expand(b, s, kv_heads, n_rep, d).reshape(b, s, kv_heads * n_rep, d)


class Attention(nn.Module):
    """Grouped-query attention with RoPE. Head counts are inferred from the
    projection outputs at run time, so tensor parallelism can shard heads."""

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.inner_attention = build_attention(args.attn_type, args.mask_spec)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        """``mask``: the batch's prepared attention mask (``models/attention.py``)."""
        bsz, seq_len, _ = x.shape
        xq = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rope_cache, positions)
        n_rep = xq.shape[2] // xk.shape[2]
        xk, xv = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
        out = self.inner_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, positions, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


_LAYER_PARAM = re.compile(r"layers\.(\d+)\.(.+)")
_NORMS = {"attention_norm.weight", "ffn_norm.weight"}
_INPUT_PROJECTIONS = {
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "feed_forward.w1.weight",
}
# std 0.02 / sqrt(2 * depth): wo and w2 write into the residual stream, so deeper
# layers add smaller updates; w3 shares the rule.
_DEPTH_SCALED = {"attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"}


class Transformer(nn.Module):
    """Llama 3 decoder.

    ``layers`` is a ``ModuleDict`` keyed ``"0" .. "n-1"`` so FQNs survive a
    pipeline stage deleting layers; a stage may also set ``tok_embeddings``,
    ``norm`` or ``output`` to ``None``, which are then skipped (without
    ``tok_embeddings`` the input is already hidden states).
    """

    def __init__(self, model_args: TransformerModelArgs) -> None:
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(
            model_args.vocab_size, model_args.dim
        )
        self.register_buffer("rope_cache", precompute_rope_cache(model_args), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(model_args) for i in range(model_args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(
            model_args.dim, model_args.vocab_size, bias=False
        )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens`` ``[batch, seq]`` (or hidden states ``[batch, seq, dim]``
        when this stage has no embedding) -> logits ``[batch, seq, vocab]`` (or
        hidden states when it has no output). ``positions``: see
        :func:`apply_rotary_emb`. ``document_ids`` ``[batch, seq]`` (of the whole
        sequence under context parallel): which packed document each token belongs to,
        for the block-causal mask."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = prepare_mask(self.layers, document_ids, h.device)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, positions, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Recompute the RoPE table (on ``buffer_device``, default: where the
        buffer already is) and initialise every parameter from ``(seed, FQN)``,
        independent of how the model is sharded, wrapped or split."""
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = precompute_rope_cache(self.model_args, device)
        for name, param in self.named_parameters():
            fqn = clean_fqn(name)
            init_param_(param, fqn, seed, self._init_fn(fqn))

    def _init_fn(self, fqn: str) -> InitFn:
        args = self.model_args
        if fqn == "tok_embeddings.weight":
            return normal_init(1.0)
        if fqn == "output.weight":
            return trunc_normal_init(args.dim**-0.5, cutoff_stds=3.0)
        if fqn == "norm.weight":
            return ones_init
        match = _LAYER_PARAM.fullmatch(fqn)
        if match is None:
            raise ValueError(f"no initialisation rule for parameter {fqn!r}")
        layer_id, rest = int(match.group(1)), match.group(2)
        if rest in _NORMS:
            return ones_init
        if rest in _INPUT_PROJECTIONS:
            return trunc_normal_init(_BASE_STD)
        if rest in _DEPTH_SCALED:
            depth = layer_id + 1 if args.depth_init else args.n_layers
            return trunc_normal_init(_BASE_STD / math.sqrt(2 * depth))
        raise ValueError(f"no initialisation rule for parameter {fqn!r}")
