"""The decoder every model here is built from: token embedding, pre-norm transformer blocks
(attention + dense SwiGLU or MoE feed-forward), final RMSNorm and output projection; the
RoPE table, the attention mask prepared once per forward, and layout-independent
initialisation by parameter FQN.

``layers`` is a ``ModuleDict`` keyed ``"0" .. "n-1"`` so that FQNs survive a pipeline stage
deleting layers; a stage may also set ``tok_embeddings``, ``norm`` or ``output`` to None,
which are then skipped (without ``tok_embeddings`` the input is already hidden states).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchtitan.layers.attention import prepare_mask
from torchtitan.layers.init import (
    InitFn,
    clean_fqn,
    init_param_,
    normal_init,
    ones_init,
    trunc_normal_init,
    zeros_init,
)
from torchtitan.layers.moe import MoE
from torchtitan.layers.rope import rope_table

BASE_STD = 0.02
_LAYER_PARAM = re.compile(r"layers\.(\d+)\.(.+)")
_FFNS = r"(feed_forward|moe\.experts|moe\.shared_experts)"

NormFactory = Callable[[int, float], nn.Module]
"""``(dim, eps) -> module``: the RMSNorm of a model (``nn.RMSNorm``, or a zero-centred one,
``layers/norms.py``)."""

RopeFrequencies = Callable[[Any, "torch.device | None"], torch.Tensor]
"""``(model_args, device) -> [rotary_dim // 2]`` fp32 RoPE inverse frequencies."""


@dataclass(frozen=True)
class InitRules:
    """Which block parameters (their FQN after ``layers.N.``) draw from truncated normals of
    std 0.02 (``plain``) and which of std ``0.02 / sqrt(2 * depth)`` (``depth_scaled``): the
    projections that write into the residual stream, so deeper layers add smaller updates
    (``w3`` shares the rule, as in Llama 3). Norm weights start at one, and the parameters
    ``zeros`` matches (gpt-oss's projection and expert biases) at zero."""

    plain: re.Pattern
    depth_scaled: re.Pattern
    zeros: re.Pattern | None = None

    @classmethod
    def for_attention(cls, input_projections: tuple[str, ...]) -> InitRules:
        """The rules for blocks whose attention reads its input through
        ``input_projections`` and writes through ``wo``; feed-forwards, experts and routers
        follow the common rule."""
        inputs = "|".join(input_projections)
        return cls(
            plain=re.compile(
                rf"attention\.({inputs})\.weight|{_FFNS}\.w1(\.weight)?|moe\.router\.gate\.weight"
            ),
            depth_scaled=re.compile(rf"attention\.wo\.weight|{_FFNS}\.(w2|w3)(\.weight)?"),
        )


class TransformerBlock(nn.Module):
    """``h = x + attention(attention_norm(x))``, then ``h + ffn(ffn_norm(h))`` where the
    feed-forward is a dense ``feed_forward`` or, when ``moe_enabled``, a ``moe`` layer. The
    ``attention`` may be any token mixer called like one (Gated DeltaNet)."""

    def __init__(
        self,
        dim: int,
        norm_eps: float,
        attention: nn.Module,
        ffn: nn.Module,
        norm: NormFactory = nn.RMSNorm,
    ) -> None:
        super().__init__()
        self.attention_norm = norm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = norm(dim, eps=norm_eps)
        self.moe_enabled = isinstance(ffn, MoE)
        if self.moe_enabled:
            self.moe = ffn
        else:
            self.feed_forward = ffn

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, positions, mask=mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Decoder(nn.Module):
    """A decoder over ``layers`` (blocks called as ``block(h, rope_cache, positions, mask)``).

    ``model_args`` needs ``vocab_size``, ``dim``, ``norm_eps`` and ``max_seq_len``.
    ``tie_word_embeddings``: the output layer uses the embedding's weight (one parameter,
    FQN ``tok_embeddings.weight``). ``depth_init``: depth-scaled stds use the layer's depth
    (else ``n_layers``). ``norm``: the final norm's type.
    """

    def __init__(
        self,
        model_args: Any,
        layers: dict[str, nn.Module],
        *,
        rope_frequencies: RopeFrequencies,
        init_rules: InitRules,
        tie_word_embeddings: bool = False,
        depth_init: bool = True,
        norm: NormFactory = nn.RMSNorm,
    ) -> None:
        super().__init__()
        self.model_args = model_args
        self._rope_frequencies = rope_frequencies
        self._init_rules = init_rules
        self._depth_init = depth_init
        self.tie_word_embeddings = tie_word_embeddings
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(
            model_args.vocab_size, model_args.dim
        )
        self.register_buffer("rope_cache", self.precompute_rope_cache(), persistent=False)
        self.layers = nn.ModuleDict(layers)
        self.norm: nn.Module | None = norm(model_args.dim, eps=model_args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        self.hidden_output = False
        self.tie_embeddings()

    def precompute_rope_cache(self, device: torch.device | None = None) -> torch.Tensor:
        """``[max_seq_len, rotary_dim]`` table (``layers/rope.py``)."""
        return rope_table(
            self._rope_frequencies(self.model_args, device), self.model_args.max_seq_len
        )

    def tie_embeddings(self) -> None:
        """With tied embeddings, point the output layer at the embedding's weight. Called
        again after anything that gives each module its own copy: moving the model across
        devices (``to_empty``) and tensor parallel."""
        if self.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Callable, recurse: bool = True) -> Decoder:
        super()._apply(fn, recurse)
        self.tie_embeddings()
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens`` ``[batch, seq]`` (or hidden states ``[batch, seq, dim]`` when this
        stage has no embedding) -> logits ``[batch, seq, vocab]`` (or hidden states when it
        has no output, or when ``hidden_output`` is set: the loss then projects them itself,
        ``layers/loss.LinearCrossEntropy``).
        ``positions``: see :func:`~torchtitan.layers.rope.apply_rope`.
        ``document_ids`` ``[batch, seq]`` (of the whole sequence under context parallel):
        which packed document each token belongs to, for the block-causal mask."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = prepare_mask(self.layers, document_ids, h.device)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, positions, mask)
        if self.norm is not None:
            h = self.norm(h)
        return h if self.output is None or self.hidden_output else self.output(h)

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Recompute the RoPE table (on ``buffer_device``, default: where the buffer already
        is), zero MoE load-balancing state and initialise every parameter from ``(seed,
        FQN)``, independent of how the model is sharded, wrapped or split."""
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self.precompute_rope_cache(device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers()
        self.init_parameters(seed)

    def init_parameters(self, seed: int, fqns: Collection[str] | None = None) -> None:
        """Initialise the parameters named by ``fqns`` (unwrapped FQNs; None: all) from
        ``(seed, FQN)``. Parameters still on meta are skipped: QLoRA's base weights, which
        are made a block at a time later (``components/qlora.PendingBase``)."""
        own_rules = self._module_init_fns()
        for name, param in self.named_parameters():
            fqn = clean_fqn(name)
            if param.is_meta or (fqns is not None and fqn not in fqns):
                continue
            init_param_(param, fqn, seed, own_rules.get(fqn) or self._init_fn(fqn))

    def _module_init_fns(self) -> dict[str, InitFn]:
        """Init rules that modules carry for parameters added to them after construction
        (``param_init_fns``: local name -> InitFn; e.g. LoRA adapters), by FQN."""
        rules: dict[str, InitFn] = {}
        for prefix, module in self.named_modules():
            for name, fn in getattr(module, "param_init_fns", {}).items():
                rules[clean_fqn(f"{prefix}.{name}" if prefix else name)] = fn
        return rules

    def _init_fn(self, fqn: str) -> InitFn:
        output_init = trunc_normal_init(self.model_args.dim**-0.5, cutoff_stds=3.0)
        if fqn == "tok_embeddings.weight":
            return output_init if self.tie_word_embeddings else normal_init(1.0)
        if fqn == "output.weight":
            return output_init
        if fqn.endswith("norm.weight"):
            return ones_init
        match = _LAYER_PARAM.fullmatch(fqn)
        rest = match.group(2) if match else ""
        if self._init_rules.zeros is not None and self._init_rules.zeros.fullmatch(rest):
            return zeros_init
        if self._init_rules.plain.fullmatch(rest):
            return trunc_normal_init(BASE_STD)
        if self._init_rules.depth_scaled.fullmatch(rest):
            depth = int(match.group(1)) + 1 if self._depth_init else self.model_args.n_layers
            return trunc_normal_init(BASE_STD / math.sqrt(2 * depth))
        raise ValueError(f"no initialisation rule for parameter {fqn!r}")
