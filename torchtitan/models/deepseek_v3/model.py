"""The DeepSeek-V3 decoder: multi-head latent attention (MLA) with decoupled RoPE, dense
feed-forward in the first ``n_dense_layers`` blocks and mixture-of-experts in the rest.

MLA: queries come from ``wq`` (or the low-rank ``wq_a`` -> ``q_norm`` -> ``wq_b``); keys
and values from one compressed latent (``wkv_a`` -> ``kv_norm`` -> ``wkv_b``). Only
``qk_rope_head_dim`` channels per head carry position: the queries' own, and one key
shared by all heads that ``wkv_a`` produces beside the latent. RoPE rotates adjacent
channel pairs ``(2i, 2i + 1)`` at frequency ``i`` (Hugging Face's ``rope_interleave``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.attention import build_attention, prepare_mask
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs, yarn_mscale
from torchtitan.models.init import (
    InitFn,
    clean_fqn,
    init_param_,
    normal_init,
    ones_init,
    trunc_normal_init,
)
from torchtitan.models.llama3.model import FeedForward
from torchtitan.models.moe import MoE

_BASE_STD = 0.02


def rope_inv_freq(args: DeepSeekV3ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """``[qk_rope_head_dim // 2]`` fp32 inverse frequencies. With YaRN (``rope_factor >
    1``) frequencies that turn fewer than ``beta_slow`` times over the original context
    are divided by the factor, those turning more than ``beta_fast`` times are kept, and a
    linear ramp over channel index blends the band between."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    if args.rope_factor <= 1:
        return inv_freq

    def channel(rotations: float) -> float:
        """The channel index whose frequency turns ``rotations`` times over the context."""
        return dim * math.log(args.rope_original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(channel(args.rope_beta_fast)), 0)
    high = min(math.ceil(channel(args.rope_beta_slow)), dim - 1)
    ramp = (torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / max(high - low, 1e-3)
    keep = 1 - ramp.clamp(0, 1)
    return inv_freq / args.rope_factor * (1 - keep) + inv_freq * keep


def precompute_rope_cache(args: DeepSeekV3ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """``[max_seq_len, qk_rope_head_dim]`` fp32: cos in the first half, sin in the second."""
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, rope_inv_freq(args, device))
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, rope_dim]`` by position (``positions``: ``[seq]``
    or ``[batch, seq]``, default ``0 .. seq - 1``), in fp32."""
    table = rope_cache[: x.shape[1]] if positions is None else rope_cache[positions]
    cos, sin = table.unsqueeze(-2).chunk(2, dim=-1)
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).type_as(x)


class MLA(nn.Module):
    """Multi-head latent attention. Head counts come from the projections' outputs, so
    tensor parallel can shard heads (``wq``/``wq_b``/``wkv_b`` column-wise)."""

    def __init__(self, args: DeepSeekV3ModelArgs) -> None:
        super().__init__()
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        q_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        kv_out = args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
        self.wkv_b = nn.Linear(args.kv_lora_rank, kv_out, bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.softmax_scale = args.softmax_scale
        self.inner_attention = build_attention(args.attn_type, args.mask_spec)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        """``mask``: the batch's prepared attention mask (``models/attention.py``)."""
        bsz, seq_len, _ = x.shape
        q = self._queries(x).view(bsz, seq_len, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seq_len, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        n_heads = kv.shape[2]
        q_rope = apply_rope(q_rope, rope_cache, positions)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope_cache, positions).expand(-1, -1, n_heads, -1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        # Values padded to the query/key head size: every SDPA backend (and context
        # parallel) then sees plain equal-size multi-head attention.
        v = F.pad(v, (0, q.shape[-1] - self.v_dim))
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   mask=mask, scale=self.softmax_scale)
        out = out.transpose(1, 2)[..., : self.v_dim].reshape(bsz, seq_len, -1)
        return self.wo(out)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MLA(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args.dim, args.moe_inter_dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, positions, mask=mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


_LAYER_PARAM = re.compile(r"layers\.(\d+)\.(.+)")
# std 0.02 / sqrt(2 * depth) for the projections writing into the residual stream (and w3,
# as in Llama 3); 0.02 for the other matrices; ones for norms.
_FFNS = r"(feed_forward|moe\.experts|moe\.shared_experts)"
_DEPTH_SCALED = re.compile(rf"attention\.wo\.weight|{_FFNS}\.(w2|w3)(\.weight)?")
_PLAIN = re.compile(
    rf"attention\.(wq|wq_a|wq_b|wkv_a|wkv_b)\.weight|{_FFNS}\.w1(\.weight)?|moe\.router\.gate\.weight"
)


class DeepSeekV3Model(nn.Module):
    """``layers`` is a ``ModuleDict`` keyed ``"0" .. "n-1"`` so FQNs survive a pipeline
    stage deleting layers; ``tok_embeddings``, ``norm`` or ``output`` may be set to None
    by a stage and are then skipped."""

    def __init__(self, model_args: DeepSeekV3ModelArgs) -> None:
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer("rope_cache", precompute_rope_cache(model_args), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, model_args) for i in range(model_args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the Llama 3 model's forward (``torchtitan/models/llama3/model.py``)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = prepare_mask(self.layers, document_ids, h.device)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, positions, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Recompute the RoPE table, zero the MoE load-balancing state and initialise every
        parameter from ``(seed, FQN)``, independent of sharding, wrapping or splitting."""
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = precompute_rope_cache(self.model_args, device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers()
        for name, param in self.named_parameters():
            fqn = clean_fqn(name)
            init_param_(param, fqn, seed, self._init_fn(fqn))

    def _init_fn(self, fqn: str) -> InitFn:
        if fqn == "tok_embeddings.weight":
            return normal_init(1.0)
        if fqn == "output.weight":
            return trunc_normal_init(self.model_args.dim**-0.5, cutoff_stds=3.0)
        if fqn.endswith("norm.weight"):
            return ones_init
        match = _LAYER_PARAM.fullmatch(fqn)
        rest = match.group(2) if match else ""
        if _PLAIN.fullmatch(rest):
            return trunc_normal_init(_BASE_STD)
        if _DEPTH_SCALED.fullmatch(rest):
            return trunc_normal_init(_BASE_STD / math.sqrt(2 * (int(match.group(1)) + 1)))
        raise ValueError(f"no initialisation rule for parameter {fqn!r}")
